"""Supervised fine-tuning of the LoRA on whole conversations (ART's ``model.train_sft``).

    save the trajectories -> render each conversation -> batches of ``batch_size``
    -> per batch: cross-entropy on the assistant tokens only, one optimizer step
    -> atomic checkpoint -> publish the adapter   (the frame is ``step.run_update``)

One call is one checkpoint (the model's step advances by one, as in ART), so SFT can warm-start
a model before RL or run between RL steps; both share the policy and its optimizer.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from ...core.backend import TrainEvent
from ...core.config import TrainSFTConfig
from ...core.errors import ConfigError
from ...core.storage import ModelStore
from ...core.trajectory import Trajectory, TrajectoryGroup, write_groups_jsonl
from ..chat_template import render_prompt
from .rows import Row
from .step import Serving, run_update

if TYPE_CHECKING:
    from .policy import Policy

log = logging.getLogger(__name__)

SFT_MICRO_BATCH_TOKENS = 4096


def _row(ids: list[int], mask: list[bool]) -> Row:
    return Row(input_ids=ids, loss_mask=mask, old_logprobs=[0.0] * len(ids),
               temperatures=[1.0] * len(ids))


def sft_rows(tokenizer: Any, trajectory: Trajectory) -> list[Row]:
    """The conversation rendered with the chat template; loss on the assistant turns only (each
    turn's tokens after its generation prompt, its end-of-turn tokens included). Turns the
    template re-renders differently later (e.g. dropping reasoning) start a new row."""
    messages, tools = trajectory.messages(), trajectory.tools
    rows: list[Row] = []
    ids: list[int] = []
    mask: list[bool] = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        prompt = render_prompt(tokenizer, messages[:i], tools)
        full = render_prompt(tokenizer, messages[: i + 1], tools, add_generation_prompt=False)
        if full[: len(prompt)] != prompt:
            log.warning("SFT: the chat template renders assistant turn %d apart from its "
                        "prompt; the turn is left out", i)
            continue
        if prompt[: len(ids)] != ids:  # history rendered differently: a row of its own
            rows.append(_row(ids, mask))
            ids, mask = [], []
        ids = ids + prompt[len(ids):]
        mask = mask + [False] * (len(ids) - len(mask))
        answer = full[len(prompt):]
        ids, mask = ids + answer, mask + [True] * len(answer)
    rows.append(_row(ids, mask))
    return [r for r in rows if r.trained_tokens]


def sft_update(policy: Policy, trajectories: list[Trajectory], config: TrainSFTConfig
               ) -> dict[str, float]:
    """Batches of ``config.batch_size`` trajectories, one optimizer step each at its learning
    rate; the loss is the mean negative log-likelihood of the batch's assistant tokens."""
    from .update import released_memory

    with released_memory(policy.device):
        return _sft_update(policy, trajectories, config)


def _sft_update(policy: Policy, trajectories: list[Trajectory], config: TrainSFTConfig
                ) -> dict[str, float]:
    from .loss import token_logprobs
    from .update import micro_batches

    size = config.resolved_batch_size
    batches = [trajectories[i:i + size] for i in range(0, len(trajectories), size)]
    rates = (iter(config.learning_rate) if isinstance(config.learning_rate, list)
             else itertools.repeat(config.learning_rate))
    policy.model.train()
    losses, norms, used_rates = [], [], []
    trained_tokens = truncated = 0
    for batch in batches:
        rows = [row for t in batch for row in sft_rows(policy.tokenizer, t)]
        for row in rows:
            if len(row) > SFT_MICRO_BATCH_TOKENS:
                row.truncate(SFT_MICRO_BATCH_TOKENS)
                truncated += 1
        rows = [r for r in rows if r.trained_tokens]
        lr = next(rates)
        if not rows:
            continue
        for group in policy.optimizer.param_groups:
            group["lr"], group["weight_decay"] = lr, 0.0
        policy.optimizer.zero_grad(set_to_none=True)
        tokens = sum(r.trained_tokens for r in rows)
        loss_sum = 0.0
        for micro in micro_batches(rows, SFT_MICRO_BATCH_TOKENS):
            t = policy.tensors(micro)
            logp = token_logprobs(policy.logits(t), t["targets"], t["temps"])
            loss = -(logp * t["mask"]).sum() / tokens
            loss.backward()
            loss_sum += float(loss.detach())
            del t, logp, loss  # nothing of a micro-batch outlives it
            policy.release_step_memory()
        norms.append(policy.clip_grad_norm(1.0))
        policy.optimizer.step()
        losses.append(loss_sum)
        used_rates.append(lr)
        trained_tokens += tokens
    if not losses:
        raise ConfigError("train_sft: no trajectory has an assistant message to train on")
    return {"loss": sum(losses) / len(losses), "grad_norm": sum(norms) / len(norms),
            "learning_rate": sum(used_rates) / len(used_rates), "sft_batches": float(len(losses)),
            "trained_tokens": float(trained_tokens), "truncated_rows": float(truncated)}


async def sft_step(step: int, trajectories: list[Trajectory], config: TrainSFTConfig, *,
                   store: ModelStore, load_policy: Callable[[], Policy], serving: Serving,
                   heartbeat_s: float = 30.0) -> AsyncIterator[TrainEvent]:
    """Fine-tune checkpoint ``step`` on ``trajectories`` (saved first, under the ``sft``
    split); yields started, heartbeats, done."""
    if isinstance(config.learning_rate, list):
        needed = -(-len(trajectories) // config.resolved_batch_size)
        if len(config.learning_rate) < needed:
            raise ConfigError(f"train_sft: {len(config.learning_rate)} learning rates for "
                              f"{needed} batches; give one per batch")
    write_groups_jsonl(store.trajectories_path("sft", step), [TrajectoryGroup(trajectories)])
    async for event in run_update(
            step, lambda policy: sft_update(policy, trajectories, config),
            summary={"num_trajectories": float(len(trajectories))}, store=store,
            load_policy=load_policy, serving=serving, heartbeat_s=heartbeat_s):
        yield event
