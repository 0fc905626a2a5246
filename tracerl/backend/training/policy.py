"""One trained model's policy: its LoRA adapter in a loaded peft model, the adapter's optimizer
and step count, and what the update (``update.py``) calls on it.

:class:`Policy` takes a model that is already loaded: :class:`~.trainer.Trainer` loads a base
of its own then constructs it; :class:`~.adapters.AdapterPolicy` constructs it on a
:class:`~.adapters.SharedBase`'s model, with its own adapter name. Its public methods are the
seam of the update (:class:`~.update.UpdatedPolicy`): ``tensors``, ``logits``,
``fill_old_logprobs``, ``prepare``, ``clip_grad_norm``, ``idle_pass``, ``sum_over_ranks``,
``max_over_ranks``, ``release_step_memory``; with ``distribute`` and
``load_optimizer_state``, run while it is constructed, they are what the distributed rank
(``rank.py``) overrides.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...core.config import LoraConfig, TrainConfig
from ...core.storage import OPTIMIZER_FILE
from ..chat_template import render_prompt, turn_end_ids
from . import checkpointing
from .head import CHUNK_ELEMENTS, head_logprobs
from .learning_rate import auto_learning_rate
from .loss import token_entropy, token_logprobs
from .rows import NAN, Row, has_unknown_logprobs
from .update import (
    accumulate_gradients,
    loss_normalizer,
    micro_batches,
    optimize,
    return_freed_memory,
    step_totals,
    update,
)

STATE_FILE = "trainer_state.json"
# config fields of models that scale or soft-cap the logits after the head (Gemma 2,
# Cohere, Granite): :meth:`Policy.logprobs` takes the materialised path for them
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


class Rendering:
    """Rows of trajectories without token records: rendered with the served chat template
    (``self.tokenizer``, set by the subclass)."""

    tokenizer: Any

    def render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> list[int]:
        """Prompt token ids of ``messages`` under the served chat template."""
        return render_prompt(self.tokenizer, messages, tools)

    def turn_end_ids(self) -> set[int]:
        """The chat template's end of an assistant turn (:func:`turn_end_ids`), once."""
        if not hasattr(self, "_turn_end"):
            self._turn_end = turn_end_ids(self.tokenizer)
        return self._turn_end

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    @property
    def eos_token_id(self) -> int | None:
        return self.tokenizer.eos_token_id


class Policy(Rendering):
    """The adapter ``adapter_name`` of ``model`` (a peft model on ``device``), its optimizer
    and step count: from the checkpoint at ``adapter_path`` (adapter, optimizer state, step
    count), or fresh. ``backend``: what loaded the model (peft, unsloth), kept in checkpoints."""

    # each rank's loss is multiplied by this before backward: data parallel wrappers average
    # gradients over ranks, and the step's gradient is their sum (1 in one process)
    gradient_scale = 1.0
    # the head's logprobs in chunks (``head.py``); False: through the full logits, as before
    # (``benchmarks/step_memory.py`` compares the two)
    fused_head = True
    # rows are right-padded, so in a causal model no real token attends to a pad: the padding
    # mask changes only the pads' own outputs (never trained on). Without it attention runs as
    # plain causal attention (sdpa's flash kernel on CPU and CUDA instead of its masked path:
    # benchmarks/train_step_mfu.py); False passes the mask, as before
    causal_without_padding_mask = True

    def __init__(self, model: Any, tokenizer: Any, lora: LoraConfig, *, device: torch.device,
                 dtype: torch.dtype, adapter_name: str = "default",
                 adapter_path: Path | None = None, backend: str = "peft") -> None:
        self.model, self.tokenizer, self.lora = model, tokenizer, lora
        self.device, self.dtype = device, dtype
        self.adapter_name, self.backend = adapter_name, backend
        self.steps_done = 0
        self.auto_learning_rate = auto_learning_rate(model.config, lora)  # learning_rate="auto"
        if adapter_path is not None:
            self._load_adapter_weights(adapter_path)
        self.forward_model = self.distribute(model)
        self.optimizer: torch.optim.Optimizer = torch.optim.AdamW(
            self.trainable_parameters(), lr=1e-5, betas=(0.9, 0.99))
        if adapter_path is not None and (adapter_path / OPTIMIZER_FILE).exists():
            self.load_optimizer_state(
                torch.load(adapter_path / OPTIMIZER_FILE, map_location=self.device))

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """The parameters a step updates (this policy's LoRA weights), in the model's order."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def _load_adapter_weights(self, path: Path) -> None:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        state = load_file(str(path / "adapter_model.safetensors"), device=str(self.device))
        result = set_peft_model_state_dict(self.model, state, adapter_name=self.adapter_name)
        unexpected = getattr(result, "unexpected_keys", None)
        if unexpected:
            raise RuntimeError(f"checkpoint {path} does not fit this LoRA config: {unexpected[:3]}")
        state_file = path / STATE_FILE
        if state_file.exists():
            self.steps_done = json.loads(state_file.read_text()).get("steps_done", 0)

    # --- a model's own step: the update of this policy alone (update.py) -------------------

    def optimize(self, rows: list[Row], config: TrainConfig) -> dict[str, float]:
        """The clipped policy loss over length-bucketed micro-batches (gradients accumulate),
        then one optimizer step per epoch. Returns the step's loss metrics."""
        return optimize([self], [rows], config)[0]

    def update(self, batches: list[list[Row]], totals: dict[str, float], config: TrainConfig
               ) -> dict[str, float]:
        """Loss and optimizer step over ``batches`` (this process's share of the step), with the
        loss normalised by ``totals`` (trained tokens and rows of the whole step)."""
        return update([self], batches, [totals], config)[0]

    def backward(self, batches: list[list[Row]], config: TrainConfig, collect: bool = True,
                 normalizer: float | None = None) -> dict[str, float]:
        """Forward and backward over all micro-batches (gradients accumulate; no optimizer
        step). The summed loss is the step's loss under ``config.loss_normalization``;
        ``normalizer`` (default: of ``batches``) is the step's trained tokens or rows."""
        if normalizer is None:
            normalizer = loss_normalizer(step_totals(batches), config)
        return accumulate_gradients(self, batches, config, {self.adapter_name: normalizer},
                                    collect)[self.adapter_name]

    def policy_logprobs(self, rows: list[Row], max_tokens: int = 8192) -> list[list[float]]:
        """The current policy's logprobs of each row's trained tokens (``tracerl doctor``
        compares them with the engine's)."""
        copies = [dataclasses.replace(r, old_logprobs=[NAN] * len(r)) for r in rows]
        self.fill_old_logprobs(micro_batches(copies, max_tokens))
        return [[lp for lp, m in zip(r.old_logprobs, r.loss_mask, strict=True) if m]
                for r in copies]

    # --- the seam of the update (update.UpdatedPolicy) ---------------------------------------

    def prepare(self, config: TrainConfig, largest: int = 0) -> dict[str, float]:
        """Seed, learning rate (of this adapter's step count under the config's schedule),
        training mode and checkpointed layers of a step under ``config`` whose largest
        micro-batch pads to ``largest`` tokens; returns the checkpointing decision's metrics
        (``checkpointing.py``)."""
        if config.seed is not None:
            torch.manual_seed(config.seed)
        for g in self.optimizer.param_groups:
            g["lr"] = config.learning_rate_at(self.steps_done, self.auto_learning_rate)
            g["weight_decay"] = config.weight_decay
        decision = self.checkpoint_plan(config, largest)
        checkpointing.apply(self.model, decision.layers, self.recompute_context)
        self.model.train()
        return decision.as_metrics()

    @contextlib.contextmanager
    def adapters_disabled(self) -> Iterator[None]:
        """Forwards inside run the base model alone (the KL term's reference), and every
        adapter trainable before stays so: peft's ``disable_adapter`` re-activates its active
        adapter on exit, which freezes the others (on a shared base, the other models')."""
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        try:
            with self.model.disable_adapter():
                yield
        finally:
            for p in trainable:
                p.requires_grad_(True)

    def recompute_context(self) -> tuple[Any, Any]:
        """The contexts of a checkpointed layer's forward and of its recompute in the backward
        pass (``checkpointing.apply``): one adapter's forward has no state to restore."""
        return contextlib.nullcontext(), contextlib.nullcontext()

    def checkpoint_plan(self, config: TrainConfig, tokens: int) -> checkpointing.Plan:
        """The layers a micro-batch of ``tokens`` padded tokens checkpoints under ``config``:
        ``gradient_checkpointing`` True or False, or ``'auto'``: within
        ``activation_memory_mb`` (unset: ``checkpointing.default_budget_mb``)."""
        mode = config.gradient_checkpointing
        budget = config.activation_memory_mb or checkpointing.default_budget_mb(self.device)
        head = self.model.get_base_model().get_output_embeddings()
        vocab = int(head.weight.shape[0]) if head is not None else 0
        if self.output_head() is not None:  # a few chunks of [tokens, vocab] fp32 at a time
            head_mb = 3 * CHUNK_ELEMENTS * 4 / checkpointing.MB
        else:  # the logits, their log-softmax and gradient: [tokens, vocab] fp32 each
            head_mb = 3 * tokens * vocab * 4 / checkpointing.MB
        return checkpointing.plan(self.model.get_base_model().config, tokens, self.dtype.itemsize,
                                  budget,
                                  head_mb, forced=None if mode == "auto" else bool(mode))

    def tensors(self, batch: list[Row]) -> dict[str, torch.Tensor]:
        """Padded tensors of a micro-batch. Logits are needed only from the first trained token
        on, so the (vocab-sized) head runs on ``keep`` positions instead of the whole row."""
        width = max(len(r) for r in batch)
        start = max(min(r.loss_mask.index(True) for r in batch), 1)
        pad = self.tokenizer.pad_token_id or 0

        def padded(values: list[list[Any]], fill: Any, dtype: Any) -> torch.Tensor:
            # numpy fills rows ~10x faster than torch.tensor() on nested lists
            arr = np.full((len(values), width), fill, dtype=dtype)
            for i, v in enumerate(values):
                arr[i, :len(v)] = v
            return torch.from_numpy(arr).to(self.device)

        ids = padded([r.input_ids for r in batch], pad, np.int64)
        old = padded([r.old_logprobs for r in batch], 0.0, np.float32)[:, start:]
        if any(r.advantages is not None for r in batch):  # per-turn credit: [B, L]
            adv = padded([r.advantages if r.advantages is not None else [r.advantage] * len(r)
                          for r in batch], 0.0, np.float32)[:, start:]
        else:  # one per row: [B]
            adv = torch.tensor([r.advantage for r in batch], dtype=torch.float32,
                               device=self.device)
        return {
            "input_ids": ids,
            "attention_mask": padded([[1] * len(r) for r in batch], 0, np.int64),
            "keep": torch.tensor(width - start + 1),
            "targets": ids[:, start:],
            "mask": padded([r.loss_mask for r in batch], False, np.bool_)[:, start:],
            # prompt positions hold NaN (no logprob); zero them, as NaN * 0 would poison the sum
            "old": torch.nan_to_num(old, nan=0.0),
            "temps": padded([r.temperatures for r in batch], 1.0, np.float32)[:, start:],
            "adv": adv,
        }

    def logits(self, t: dict[str, torch.Tensor]) -> torch.Tensor:
        """Logits predicting ``t['targets']`` (positions start-1 .. width-2).

        On CUDA the forward runs under bf16 autocast: peft keeps LoRA weights in fp32 (the
        master copy the optimizer updates), and without autocast every adapter matmul would
        run as an fp32 GEMM with casts around it (measured: ~30% of a 0.5B step on an H200).
        """
        with self.autocast():
            out = self.forward_model(
                input_ids=t["input_ids"],
                attention_mask=self.padding_mask(t),
                logits_to_keep=int(t["keep"]),
                use_cache=False,
            )  # no KV cache in training
        return out.logits[:, :-1]

    def hidden(self, t: dict[str, torch.Tensor]) -> torch.Tensor:
        """The model body's last hidden states [B, width, H] (the head's input), under the
        same autocast as :meth:`logits`."""
        with self.autocast():
            out = self.model.get_base_model().get_decoder()(
                input_ids=t["input_ids"], attention_mask=self.padding_mask(t), use_cache=False)
        return out.last_hidden_state

    def autocast(self) -> Any:
        """bf16 (or fp16) autocast on CUDA for a half-precision policy; none for float32."""
        half = self.device.type == "cuda" and self.dtype != torch.float32
        return torch.autocast(self.device.type, dtype=self.dtype, enabled=half)

    def padding_mask(self, t: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """The micro-batch's padding mask for the model, or None where causal attention alone
        gives its real tokens the same outputs (:attr:`causal_without_padding_mask`; peft's
        models, whose attention is sdpa or eager: FlashAttention-2 unpads by the mask, and
        Unsloth's kernels are its own)."""
        attention = getattr(self.model.get_base_model().config, "_attn_implementation", None)
        if (self.causal_without_padding_mask and self.backend == "peft"
                and attention in ("sdpa", "eager")):
            return None
        return t["attention_mask"]

    def output_head(self) -> torch.nn.Linear | None:
        """The frozen linear head :meth:`logprobs` projects in chunks, or None where the full
        logits are the way (:attr:`fused_head` off, Unsloth's model, a distributed wrapper whose
        forward must run, a trained head, logits scaled or soft-capped after the head)."""
        if not self.fused_head or self.backend != "peft" or self.forward_model is not self.model:
            return None
        base = self.model.get_base_model()
        head = base.get_output_embeddings()
        if type(head) is not torch.nn.Linear or head.weight.requires_grad:
            return None  # e.g. a LoRA on lm_head, or a head in modules_to_save
        if any(getattr(base.config, k, None) is not None for k in LOGIT_TRANSFORMS):
            return None
        return head

    def logprobs(self, t: dict[str, torch.Tensor], entropy: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probabilities of ``t['targets']`` [B, L] at temperature ``t['temps']`` and, with
        ``entropy``, each position's entropy (no gradient); only ``t['mask']``'s positions are
        computed (the others are 0, or on the full-logits path whatever the logits give).

        The head runs on the trained positions only, in chunks (``head.py``): no
        ``[tokens, vocab]`` logits; without an :meth:`output_head`, through :meth:`logits`."""
        mask, temps = t["mask"], t["temps"]
        head = self.output_head()
        if head is None:
            logits = self.logits(t)
            logp = token_logprobs(logits, t["targets"], temps)
            if not entropy:
                return logp, None
            with torch.no_grad():
                trained = token_entropy(logits.detach()[mask], temps[mask])
            return logp, torch.zeros_like(logp).masked_scatter(mask, trained)
        width, length = t["input_ids"].shape[1], mask.shape[1]
        h = self.hidden(t)[:, width - length - 1:width - 1][mask]  # those predicting targets
        lp, ent = head_logprobs(h, head.weight, head.bias, t["targets"][mask], temps[mask],
                                entropy)
        zeros = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
        return (zeros.masked_scatter(mask, lp),
                None if ent is None else zeros.masked_scatter(mask, ent))

    @torch.no_grad()
    def fill_old_logprobs(self, batches: list[list[Row]]) -> None:
        """Rows without engine logprobs get the current policy's (an on-policy ratio of 1)."""
        for batch in batches:
            if not any(has_unknown_logprobs(r) for r in batch):
                continue
            t = self.tensors(batch)
            logp = self.logprobs(t)[0].cpu()
            start = t["input_ids"].shape[1] - logp.shape[1]
            for i, row in enumerate(batch):
                for j in range(start, len(row)):
                    if row.loss_mask[j] and math.isnan(row.old_logprobs[j]):
                        row.old_logprobs[j] = float(logp[i, j - start])
            del t, logp
            self.release_step_memory()

    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip this policy's gradient to ``max_norm``; its norm before clipping."""
        return float(torch.nn.utils.clip_grad_norm_(self.trainable_parameters(), max_norm))

    def release_step_memory(self) -> None:
        """Between micro-batches: hand the freed memory back (CPU; CUDA's cache is reused)."""
        if self.device.type == "cpu":
            return_freed_memory()

    # --- what the distributed rank overrides; one process needs none -------------------------

    def distribute(self, model: Any) -> Any:
        """The module the training forward runs through (DDP wraps it; FSDP2 shards it)."""
        return model

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        """The optimizer state of a checkpoint (the one-process format)."""
        self.optimizer.load_state_dict(state)

    def idle_pass(self, config: TrainConfig, backward: bool) -> None:
        """The passes of a micro-batch slot without rows, which keep ranks' collectives equal;
        one process has no such slot."""

    def sum_over_ranks(self, values: dict[str, float]) -> dict[str, float]:
        """Metric sums of this process's micro-batches -> of the whole step."""
        return values

    def max_over_ranks(self, value: float) -> float:
        """The largest of every rank's ``value``: one process has one."""
        return value

    # --- checkpoints -------------------------------------------------------------------------

    def save(self, out_dir: Path) -> None:
        """Write the adapter (vLLM/peft loadable), optimizer state and step count."""
        self.model.save_pretrained(str(out_dir))
        self.save_state(out_dir)

    def save_state(self, out_dir: Path) -> None:
        """The optimizer state and step count beside the adapter."""
        torch.save(self.optimizer.state_dict(), Path(out_dir) / OPTIMIZER_FILE)
        (Path(out_dir) / STATE_FILE).write_text(json.dumps({"steps_done": self.steps_done,
                                                            "backend": self.backend}))

    def close(self) -> None:
        """Release what the policy holds outside this process (nothing here)."""
