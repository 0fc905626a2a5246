"""Training rows from recorded token ids: token-in/token-out, never re-rendered when ids exist.

A call of a rollout joins an earlier call's row when that row (prompt + completion) is an exact
token prefix of its prompt (the usual multi-turn case: the gateway splices each turn onto the
previous tokens, :mod:`tracerl.backend.gateway.turns`); otherwise it is a row of its own, and
the reason its record gives (``metadata["turn"]``) is counted. Only sampled completion tokens
carry loss. Trajectories without token records
fall back to chat-template rendering, counted in the ``rendered_rows`` metric.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from openai.types.chat.chat_completion import Choice

from ...core.errors import InvalidTrajectoryError
from ...core.trajectory import MAX_REWARD, Conversation, LLMCall, TrajectoryGroup, is_greedy
from .credit import GroupCredit, check_turn_metadata

NAN = float("nan")


@dataclass
class Row:
    """One training sequence: tokens, which of them are trained, and the sampling policy's view."""

    input_ids: list[int]
    loss_mask: list[bool]
    old_logprobs: list[float]   # per token; NaN where unknown (then recomputed on-policy)
    temperatures: list[float]   # per token, the temperature it was sampled at
    advantage: float = 0.0
    # per token (per-turn credit): each trained token's advantage, 0 elsewhere; None: every
    # token has ``advantage``
    advantages: list[float] | None = None
    group: int = 0
    trajectory: int = 0         # index within its group
    rendered: bool = False
    # the trainer's logprobs of the trained tokens in the step's first pass (the viewer's
    # engine/trainer difference per token)
    trainer_logprobs: list[float] | None = None
    # the adapter it trains when one step trains several models on one base ("": the policy's)
    adapter: str = ""

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def trained_tokens(self) -> int:
        return sum(self.loss_mask)

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` tokens (a row longer than a micro-batch)."""
        for name in ("input_ids", "loss_mask", "old_logprobs", "temperatures"):
            setattr(self, name, getattr(self, name)[:length])
        if self.advantages is not None:
            self.advantages = self.advantages[:length]


@dataclass
class RowStats:
    """How a step's rows were built: merged turns, prefix mismatches, rendered fallbacks."""

    rows: int = 0
    # multi-turn rollouts: a call continuing the previous one's tokens joins its row
    merged_calls: int = 0
    prefix_mismatches: int = 0
    # why a turn did not continue its rollout's tokens (the gateway's verdict on its record):
    history_edits: int = 0       # the agent changed an earlier message
    new_conversations: int = 0   # a conversation of its own in the rollout (a subagent)
    unspliced_turns: int = 0     # not spliced (template, cut completion, engine, no verdict)
    # the first message index the agent edited (None: no edit)
    history_edit_message: int | None = None
    # fallbacks and losses: rendered text, trajectories without rows, rows cut to fit
    rendered_rows: int = 0
    empty_trajectories: int = 0
    truncated_rows: int = 0
    # per-turn credit (None without it, so no metric): turns, states that several turns share
    # (GiGPO's step groups), turns in those, and the mean |turn_weight * A_step| of a turn
    turns: int | None = None
    step_groups: int | None = None
    grouped_turns: int | None = None
    step_advantage_abs: float | None = None

    def add_credit(self, credit: GroupCredit) -> None:
        """Count a group's turns and step groups (per-turn credit)."""
        before = self.turns or 0
        total = (self.step_advantage_abs or 0.0) * before + sum(map(abs, credit.step_advantages))
        self.turns = before + credit.n_turns
        self.step_groups = (self.step_groups or 0) + credit.step_groups
        self.grouped_turns = (self.grouped_turns or 0) + credit.grouped_turns
        self.step_advantage_abs = total / self.turns if self.turns else 0.0

    def as_metrics(self) -> dict[str, float]:
        return {name: float(value) for name, value in dataclasses.asdict(self).items()
                if value is not None}

    def mismatch(self, call: LLMCall) -> None:
        """Count a call that continued no row, by the reason its record gives."""
        self.prefix_mismatches += 1
        turn = call.metadata.get("turn") or {}
        verdict = turn.get("verdict")
        if verdict == "history_edited":
            self.history_edits += 1
            at = turn.get("message")
            if isinstance(at, int) and (self.history_edit_message is None
                                        or at < self.history_edit_message):
                self.history_edit_message = at
        elif verdict == "new_conversation":
            self.new_conversations += 1
        else:
            self.unspliced_turns += 1


def _temperature(call: LLMCall) -> float:
    return 1.0 if is_greedy(call.temperature) else call.temperature


def _start_row(call: LLMCall, completion_index: int, advantage: float | None) -> Row:
    comp = call.completions[completion_index]
    n_prompt, n_comp = len(call.prompt_token_ids), len(comp.token_ids)
    logprobs = comp.logprobs if comp.logprobs is not None else [NAN] * n_comp
    t = _temperature(call)
    return Row(
        input_ids=list(call.prompt_token_ids) + list(comp.token_ids),
        loss_mask=[False] * n_prompt + [True] * n_comp,
        old_logprobs=[NAN] * n_prompt + list(logprobs),
        temperatures=[t] * (n_prompt + n_comp),
        advantages=None if advantage is None else [0.0] * n_prompt + [advantage] * n_comp,
    )


def _extend_row(row: Row, call: LLMCall, advantage: float | None) -> None:
    """Append the new part of ``call``'s prompt and its first completion to ``row``."""
    comp = call.completions[0]
    extra = call.prompt_token_ids[len(row.input_ids):]
    logprobs = comp.logprobs if comp.logprobs is not None else [NAN] * len(comp.token_ids)
    t = _temperature(call)
    row.input_ids += list(extra) + list(comp.token_ids)
    row.loss_mask += [False] * len(extra) + [True] * len(comp.token_ids)
    row.old_logprobs += [NAN] * len(extra) + list(logprobs)
    row.temperatures += [t] * (len(extra) + len(comp.token_ids))
    if row.advantages is not None and advantage is not None:
        row.advantages += [0.0] * len(extra) + [advantage] * len(comp.token_ids)


def _continued(rows: list[Row], prompt: list[int]) -> Row | None:
    """The latest row that ``prompt`` continues token for token (interleaved subagents and
    branches continue an earlier row than the last)."""
    for row in reversed(rows):
        if len(row.input_ids) <= len(prompt) and prompt[:len(row.input_ids)] == row.input_ids:
            return row
    return None


def rows_from_calls(calls: list[LLMCall], stats: RowStats,
                    turn_advantages: Mapping[str, float] | None = None) -> list[Row]:
    """Rows of one trajectory from its recorded calls (merging exact-prefix continuations);
    with ``turn_advantages`` (call id -> advantage: per-turn credit) each row carries its
    tokens' advantages, those of the call that sampled them."""
    rows: list[Row] = []
    for call in sorted(calls, key=lambda c: c.created_at):
        if call.error or not call.completions or not call.prompt_token_ids:
            continue
        adv = None if turn_advantages is None else turn_advantages.get(call.id, 0.0)
        if len(call.completions) > 1:  # n > 1: every sample is its own row
            rows.extend(_start_row(call, i, adv) for i in range(len(call.completions)))
            continue
        row = _continued(rows, call.prompt_token_ids)
        if row is not None:
            _extend_row(row, call, adv)
            stats.merged_calls += 1
            continue
        if rows:
            stats.mismatch(call)
        rows.append(_start_row(call, 0, adv))
    return rows


Renderer = Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], list[int]]


def rows_from_messages(
    conversation: Conversation,
    render: Renderer,
    tokenize: Callable[[str], list[int]],
    eos_id: int | None,
) -> list[Row]:
    """Fallback: render each Choice's conversation with the chat template (flagged)."""
    rows = []
    history: list[dict[str, Any]] = []
    for item in conversation.messages_and_choices:
        if isinstance(item, Choice):
            prompt = render(history, conversation.tools)
            extra = item.model_extra or {}
            completion = list(extra.get("token_ids") or [])
            if not completion:
                completion = tokenize(item.message.content or "")
                if eos_id is not None and item.finish_reason == "stop":
                    completion.append(eos_id)
            logprobs = [NAN] * len(completion)
            if (
                item.logprobs is not None
                and item.logprobs.content
                and len(item.logprobs.content) == len(completion)
            ):
                logprobs = [e.logprob for e in item.logprobs.content]
            rows.append(
                Row(
                    input_ids=prompt + completion,
                    loss_mask=[False] * len(prompt) + [True] * len(completion),
                    old_logprobs=[NAN] * len(prompt) + logprobs,
                    temperatures=[1.0] * (len(prompt) + len(completion)),
                    rendered=True,
                )
            )
            history.append(item.message.model_dump(exclude_none=True))
        else:
            history.append(item)
    return rows


def has_unknown_logprobs(row: Row) -> bool:
    return any(m and math.isnan(lp) for m, lp in zip(row.loss_mask, row.old_logprobs, strict=True))


def _check_ids(where: str, ids: list[int], vocab_size: int) -> None:
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise InvalidTrajectoryError(f"{where}[{i}]: token id {t!r} is outside the model's "
                                         f"vocabulary [0, {vocab_size})")


def _check_choices(where: str, items: list[Any], vocab_size: int) -> None:
    for i, item in enumerate(items):
        if isinstance(item, Choice):
            _check_ids(f"{where}.messages_and_choices[{i}].token_ids",
                       list((item.model_extra or {}).get("token_ids") or []), vocab_size)


def check_token_records(groups: list[TrajectoryGroup], vocab_size: int, context: int) -> None:
    """Raise :class:`InvalidTrajectoryError` naming the first row the model cannot train on
    (``groups[g].trajectories[t].llm_calls[c]...``): a token id outside ``[0, vocab_size)``
    (the embedding would index past its end), ids and logprobs of different lengths, or a call
    whose prompt and completion are longer than ``context`` tokens (the served context length:
    the engine cannot have sampled it), a reward beyond ``±MAX_REWARD`` (its group's mean and
    variance would overflow), ``metadata["turn_rewards"]`` / ``["turn_states"]`` that are not
    one number / string per turn (:mod:`.credit`). Run before a step queues or writes anything."""
    for g, group in enumerate(groups):
        for t, trajectory in enumerate(group.trajectories):
            where = f"groups[{g}].trajectories[{t}]"
            if abs(trajectory.reward) > MAX_REWARD:
                raise InvalidTrajectoryError(
                    f"{where}.reward: {trajectory.reward!r} is beyond ±{MAX_REWARD:g}: rewards "
                    "that large overflow the group's mean and variance; scale them down")
            check_turn_metadata(trajectory, where)
            _check_choices(where, trajectory.messages_and_choices, vocab_size)
            for h, history in enumerate(trajectory.additional_histories):
                _check_choices(f"{where}.additional_histories[{h}]",
                               history.messages_and_choices, vocab_size)
            for c, call in enumerate(trajectory.llm_calls):
                at = f"{where}.llm_calls[{c}]"
                _check_ids(f"{at}.prompt_token_ids", call.prompt_token_ids, vocab_size)
                for k, comp in enumerate(call.completions):
                    _check_ids(f"{at}.completions[{k}].token_ids", comp.token_ids, vocab_size)
                    if comp.logprobs is not None and len(comp.logprobs) != len(comp.token_ids):
                        raise InvalidTrajectoryError(
                            f"{at}.completions[{k}].logprobs: {len(comp.logprobs)} logprobs for "
                            f"{len(comp.token_ids)} token ids")
                    length = len(call.prompt_token_ids) + len(comp.token_ids)
                    if length > context:
                        raise InvalidTrajectoryError(
                            f"{at}: prompt and completion {k} hold {length} tokens, more than "
                            f"the model's context length of {context}")
