"""The LoRA GRPO trainer: peft on transformers, or Unsloth's FastLanguageModel when importable
on a GPU (same loss, same rows). One ``train_step`` is one optimizer step per epoch over
length-bucketed micro-batches with gradient accumulation.
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib.util
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...core import settings
from ...core.config import LoraConfig, TrainConfig
from ...core.storage import OPTIMIZER_FILE
from ..chat_template import apply_chat_template_override, render_prompt
from .loss import grpo_per_token_loss, reduce_loss, token_entropy, token_logprobs
from .rows import NAN, Row, has_unknown_logprobs

STATE_FILE = "trainer_state.json"
# the sums a step's metrics are made of (per trained token, but the loss)
METRIC_SUMS = ("loss", "ratio", "clip_fraction", "kl", "entropy", "logprob_mismatch", "engine_kl")


def unsloth_usable() -> bool:
    return (not settings.TRACERL_DISABLE_UNSLOTH.get() and torch.cuda.is_available()
            and importlib.util.find_spec("unsloth") is not None)


def return_freed_memory() -> None:
    """Hand memory a step freed back to the OS. glibc keeps freed heap pages of the step's big
    temporaries (logits, activations): measured on CPU, the RSS of a process that trains grew by
    GBs per step (5.3 GiB after 2 demo steps, 14.5 GiB after 12) and stays ~1.6 GiB with this."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc (musl...): nothing to do
            pass


def micro_batches(rows: list[Row], max_tokens: int) -> list[list[Row]]:
    """Length-bucketed batches whose padded size (rows x longest) stays within ``max_tokens``."""
    batches: list[list[Row]] = []
    current: list[Row] = []
    for row in sorted(rows, key=len, reverse=True):
        longest = len(current[0]) if current else len(row)
        if current and (len(current) + 1) * longest > max_tokens:
            batches.append(current)
            current = []
        current.append(row)
    if current:
        batches.append(current)
    return batches


def step_totals(batches: list[list[Row]]) -> dict[str, float]:
    """What a step's loss is normalised by and its metrics count: trained tokens, rows, tokens
    and micro-batches."""
    rows = [r for b in batches for r in b]
    return {"trained_tokens": float(sum(r.trained_tokens for r in rows)),
            "rows": float(len(rows)), "tokens": float(sum(len(r) for r in rows)),
            "micro_batches": float(len(batches))}


def step_metrics(sums: dict[str, float], totals: dict[str, float], grad_norm: float,
                 config: TrainConfig) -> dict[str, float]:
    """A step's metrics from its metric sums and totals (:func:`step_totals`)."""
    n = totals["trained_tokens"]
    metrics = dict(
        loss=sums["loss"],
        ratio=sums["ratio"] / n,
        clip_fraction=sums["clip_fraction"] / n,
        kl=sums["kl"] / n,
        entropy=sums["entropy"] / n,
        logprob_mismatch=sums["logprob_mismatch"] / n,
        engine_kl=sums["engine_kl"] / n,
        grad_norm=grad_norm,
        trained_tokens=n,
        tokens=totals["tokens"],
        micro_batches=totals["micro_batches"],
        learning_rate=config.learning_rate,
    )
    if not math.isfinite(metrics["loss"]):
        raise FloatingPointError(f"non-finite loss {metrics['loss']} in a training step")
    return metrics


def adapter_masks(batch: list[Row], mask: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The trained-token mask of each adapter's rows in a micro-batch (:attr:`Row.adapter`):
    ``mask`` itself when one adapter has them all."""
    names = list(dict.fromkeys(r.adapter for r in batch))
    if len(names) == 1:
        return [(names[0], mask)]
    return [(name, mask & torch.tensor([r.adapter == name for r in batch],
                                       device=mask.device)[:, None]) for name in names]


def _keep_trainer_logprobs(batch: list[Row], logp: torch.Tensor, width: int) -> None:
    """Each row's trainer logprobs of its trained tokens (``logp`` covers the last columns)."""
    lp, start = logp.cpu(), width - logp.shape[1]
    for i, row in enumerate(batch):
        row.trainer_logprobs = [float(lp[i, j - start]) for j in range(start, len(row))
                                if row.loss_mask[j]]


class Rendering:
    """Rows of trajectories without token records: rendered with the served chat template
    (``self.tokenizer``, set by the subclass)."""

    tokenizer: Any

    def render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> list[int]:
        """Prompt token ids of ``messages`` under the served chat template."""
        return render_prompt(self.tokenizer, messages, tools)

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    @property
    def eos_token_id(self) -> int | None:
        return self.tokenizer.eos_token_id


class Trainer(Rendering):
    """Holds the policy (base + LoRA) and its optimizer between steps."""

    # each rank's loss is multiplied by this before backward: data parallel wrappers average
    # gradients over ranks, and the step's gradient is their sum (1 in one process)
    gradient_scale = 1.0
    # the peft adapter this policy trains (several share one base: training/adapters.py)
    adapter_name = "default"

    def __init__(self, model_path: Path, lora: LoraConfig, adapter_path: Path | None = None,
                 device: str | None = None, chat_template: str | None = None) -> None:
        from transformers import AutoTokenizer

        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        apply_chat_template_override(self.tokenizer, chat_template)
        self.lora = lora
        self.backend = "unsloth" if unsloth_usable() and self.device.type == "cuda" else "peft"
        self.model = (
            self._load_unsloth(model_path)
            if self.backend == "unsloth"
            else self._load_peft(model_path)
        )
        self._start(adapter_path)

    def _start(self, adapter_path: Path | None) -> None:
        """Load the adapter (and its optimizer state) of ``adapter_path``, or start afresh."""
        self.steps_done = 0
        if adapter_path is not None:
            self._load_adapter_weights(adapter_path)
        self.forward_model = self._distribute(self.model)
        self.optimizer = torch.optim.AdamW(self.trainable_parameters(), lr=1e-5,
                                           betas=(0.9, 0.99))
        if adapter_path is not None and (adapter_path / OPTIMIZER_FILE).exists():
            self._load_optimizer_state(
                torch.load(adapter_path / OPTIMIZER_FILE, map_location=self.device))

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """The parameters a step updates (this policy's LoRA weights), in the model's order."""
        return [p for p in self.model.parameters() if p.requires_grad]

    # --- hooks of the distributed trainer (training/rank.py); one process needs none -------

    def _distribute(self, model: Any) -> Any:
        """The module the training forward runs through (DDP wraps it; FSDP2 shards it)."""
        return model

    def _load_optimizer_state(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)

    def _sum_over_ranks(self, values: dict[str, float]) -> dict[str, float]:
        """Metric sums of this process's micro-batches -> of the whole step."""
        return values

    def _clip_grad_norm(self, max_norm: float) -> float:
        return float(torch.nn.utils.clip_grad_norm_(self.trainable_parameters(), max_norm))

    def close(self) -> None:
        """Release what the policy holds outside this process (nothing here)."""

    # --- loading ---------------------------------------------------------------------------

    def _peft_config(self) -> Any:
        from peft import LoraConfig as PeftLoraConfig

        return PeftLoraConfig(
            r=self.lora.r,
            lora_alpha=self.lora.alpha,
            lora_dropout=self.lora.dropout,
            target_modules=list(self.lora.target_modules),
            task_type="CAUSAL_LM",
        )

    def _load_peft(self, model_path: Path) -> Any:
        from peft import get_peft_model
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(model_path, dtype=self.dtype)
        base = base.to(self.device)  # type: ignore[arg-type]  # wraps() on .to: device as self
        return get_peft_model(base, self._peft_config())

    def _load_unsloth(self, model_path: Path) -> Any:  # pragma: no cover - GPU only
        # the loss needs logits, not Unsloth's fused cross-entropy
        os.environ.setdefault("UNSLOTH_RETURN_LOGITS", "1")
        from transformers import AutoConfig
        from unsloth import FastLanguageModel

        # the model's own context length: a longer one makes Unsloth rescale RoPE, and the
        # trained policy would no longer be the served one
        max_len = getattr(AutoConfig.from_pretrained(model_path), "max_position_embeddings", 8192)
        model, _ = FastLanguageModel.from_pretrained(
            model_name=str(model_path), dtype=self.dtype, load_in_4bit=False, max_seq_length=max_len
        )
        return FastLanguageModel.get_peft_model(
            model, r=self.lora.r, lora_alpha=self.lora.alpha, lora_dropout=self.lora.dropout,
            target_modules=list(self.lora.target_modules), use_gradient_checkpointing=False)

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

    # --- the step --------------------------------------------------------------------------

    def _tensors(self, batch: list[Row]) -> dict[str, torch.Tensor]:
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
        return {
            "input_ids": ids,
            "attention_mask": padded([[1] * len(r) for r in batch], 0, np.int64),
            "keep": torch.tensor(width - start + 1),
            "targets": ids[:, start:],
            "mask": padded([r.loss_mask for r in batch], False, np.bool_)[:, start:],
            # prompt positions hold NaN (no logprob); zero them, as NaN * 0 would poison the sum
            "old": torch.nan_to_num(old, nan=0.0),
            "temps": padded([r.temperatures for r in batch], 1.0, np.float32)[:, start:],
            "adv": torch.tensor(
                [r.advantage for r in batch], dtype=torch.float32, device=self.device
            ),
        }

    def _logits(self, t: dict[str, torch.Tensor]) -> torch.Tensor:
        """Logits predicting ``t['targets']`` (positions start-1 .. width-2).

        On CUDA the forward runs under bf16 autocast: peft keeps LoRA weights in fp32 (the
        master copy the optimizer updates), and without autocast every adapter matmul would
        run as an fp32 GEMM with casts around it (measured: ~30% of a 0.5B step on an H200).
        """
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.device.type == "cuda"):
            out = self.forward_model(
                input_ids=t["input_ids"],
                attention_mask=t["attention_mask"],
                logits_to_keep=int(t["keep"]),
                use_cache=False,
            )  # no KV cache in training
        return out.logits[:, :-1]

    def optimize(self, rows: list[Row], config: TrainConfig) -> dict[str, float]:
        """The clipped policy loss over length-bucketed micro-batches (gradients accumulate),
        then one optimizer step per epoch. Returns the step's loss metrics."""
        try:
            return self._optimize(rows, config)
        finally:
            if self.device.type == "cpu":
                return_freed_memory()
            elif self.device.type == "cuda":
                # PyTorch keeps the step's freed activations and gradients cached; vLLM wakes up
                # into that memory (H200: the trainer held 4.1 GiB after one step of a 135M model;
                # for a 7B it would be tens of GiB and vLLM's wake-up would run out).
                torch.cuda.empty_cache()

    def _optimize(self, rows: list[Row], config: TrainConfig) -> dict[str, float]:
        batches = micro_batches(rows, config.micro_batch_tokens)
        return self.update(batches, step_totals(batches), config)

    def update(self, batches: list[list[Row]], totals: dict[str, float], config: TrainConfig
               ) -> dict[str, float]:
        """Loss and optimizer step over ``batches`` (this process's share of the step), with the
        loss normalised by ``totals`` (trained tokens and rows of the whole step)."""
        self.prepare(config)
        self._fill_old_logprobs(batches)
        normalizer = totals["trained_tokens" if config.loss_normalization == "token" else "rows"]
        grad_norm = 0.0
        sums: dict[str, float] = {}
        for epoch in range(config.num_epochs):  # metrics describe the first pass
            self.optimizer.zero_grad(set_to_none=True)
            epoch_sums = self.backward(batches, config, collect=epoch == 0, normalizer=normalizer)
            sums = sums or epoch_sums
            if config.max_grad_norm is not None:
                grad_norm = self._clip_grad_norm(config.max_grad_norm)
            self.optimizer.step()
        self.steps_done += 1
        return step_metrics(self._sum_over_ranks(sums), totals, grad_norm, config)

    def prepare(self, config: TrainConfig) -> None:
        """Seed, learning rate and training mode of a step under ``config``."""
        if config.seed is not None:
            torch.manual_seed(config.seed)
        for g in self.optimizer.param_groups:
            g["lr"] = config.learning_rate
            g["weight_decay"] = config.weight_decay
        if config.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
            self.model.enable_input_require_grads()
        elif getattr(self.model, "is_gradient_checkpointing", False):  # an earlier step's
            self.model.gradient_checkpointing_disable()
        self.model.train()

    def backward(self, batches: list[list[Row]], config: TrainConfig, collect: bool = True,
                 normalizer: float | None = None) -> dict[str, float]:
        """Forward and backward over all micro-batches (gradients accumulate; no optimizer
        step). The summed loss is the step's loss under ``config.loss_normalization``;
        ``normalizer`` (default: of ``batches``) is the step's trained tokens or rows."""
        if normalizer is None:
            totals = step_totals(batches)
            normalizer = totals["trained_tokens" if config.loss_normalization == "token"
                                else "rows"]
        names = {r.adapter for b in batches for r in b} or {""}
        return self.backward_by_adapter(batches, config, dict.fromkeys(names, normalizer),
                                        collect)[names.pop()]

    def backward_by_adapter(self, batches: list[list[Row]], config: TrainConfig,
                            normalizers: dict[str, float], collect: bool = True
                            ) -> dict[str, dict[str, float]]:
        """:meth:`backward` of rows that train several adapters (:attr:`Row.adapter`): each
        adapter's loss is normalised by its own step's ``normalizers[adapter]``, so its gradient
        is the one of its rows alone. Returns each adapter's metric sums."""
        sums = {name: dict.fromkeys(METRIC_SUMS, 0.0) for name in normalizers}
        for batch in batches:
            self._micro_batch(batch, config, normalizers, sums if collect else None)
            # nothing of a micro-batch outlives it: what it freed goes back to the OS before the
            # next one (glibc keeps freed heap pages; a step's RSS grew micro-batch by
            # micro-batch without this, benchmarks/train_step_memory.py)
            self._release_step_memory()
        return sums

    def _micro_batch(self, batch: list[Row], config: TrainConfig, normalizers: dict[str, float],
                     sums: dict[str, dict[str, float]] | None) -> None:
        """Forward, loss and backward of one micro-batch, each adapter's rows normalised by its
        own ``normalizers[adapter]``; adds each adapter's metrics to ``sums`` (None: no
        metrics). Its tensors (logits, logprobs, the graph) die when it returns."""
        t = self._tensors(batch)
        logits = self._logits(t)
        logp = token_logprobs(logits, t["targets"], t["temps"])
        ref = None
        if config.beta > 0:
            with torch.no_grad(), self.model.disable_adapter():
                ref = token_logprobs(self._logits(t), t["targets"], t["temps"])
        per_token, parts = grpo_per_token_loss(
            logp, t["old"], t["adv"], epsilon=config.epsilon, epsilon_high=config.epsilon_high,
            beta=config.beta, ref_logp=ref, kl_bias_correction=config.kl_bias_correction,
            loss_fn=config.loss_fn)
        loss: torch.Tensor | None = None
        for name, mask in adapter_masks(batch, t["mask"]):
            part = reduce_loss(per_token, mask, config.loss_normalization,
                               normalizers[name] / self.gradient_scale)
            loss = part if loss is None else loss + part
            if sums is not None:
                self._collect(sums[name], part, logits, logp, parts, mask, t)
        assert loss is not None  # a micro-batch has rows
        loss.backward()
        if sums is not None:
            _keep_trainer_logprobs(batch, logp.detach(), int(t["input_ids"].shape[1]))

    def _collect(self, sums: dict[str, float], loss: torch.Tensor, logits: torch.Tensor,
                 logp: torch.Tensor, parts: dict[str, torch.Tensor], m: torch.Tensor,
                 t: dict[str, torch.Tensor]) -> None:
        """Add the metric sums of the tokens of mask ``m`` (one adapter's rows)."""
        sums["loss"] += float(loss.detach()) / self.gradient_scale
        sums["ratio"] += float(parts["ratio"][m].sum())
        sums["clip_fraction"] += float(parts["clipped"][m].float().sum())
        engine_diff = (logp.detach() - t["old"])[m]  # trainer - engine, per sampled token
        sums["logprob_mismatch"] += float(engine_diff.abs().sum())
        # KL(engine || trainer), k3 estimate over tokens the engine sampled (step health):
        # e^d - 1 - d >= 0 for every token; in float32, e^d - d - 1 of d near 0 cancelled
        # to slightly below 0 (a CI step with equal weights summed to -2e-9)
        d = engine_diff.double()
        sums["engine_kl"] += float((torch.expm1(d) - d).clamp_min(0).sum())
        if "kl" in parts:
            sums["kl"] += float(parts["kl"][m].sum())
        with torch.no_grad():
            sums["entropy"] += float(token_entropy(logits.detach()[m], t["temps"][m]).sum())

    def _release_step_memory(self) -> None:
        """Between micro-batches: hand the freed memory back (CPU; CUDA's cache is reused)."""
        if self.device.type == "cpu":
            return_freed_memory()

    def policy_logprobs(self, rows: list[Row], max_tokens: int = 8192) -> list[list[float]]:
        """The current policy's logprobs of each row's trained tokens (``tracerl doctor``
        compares them with the engine's)."""
        copies = [dataclasses.replace(r, old_logprobs=[NAN] * len(r)) for r in rows]
        self._fill_old_logprobs(micro_batches(copies, max_tokens))
        return [[lp for lp, m in zip(r.old_logprobs, r.loss_mask, strict=True) if m]
                for r in copies]

    @torch.no_grad()
    def _fill_old_logprobs(self, batches: list[list[Row]]) -> None:
        """Rows without engine logprobs get the current policy's (an on-policy ratio of 1)."""
        for batch in batches:
            if not any(has_unknown_logprobs(r) for r in batch):
                continue
            t = self._tensors(batch)
            logp = token_logprobs(self._logits(t), t["targets"], t["temps"]).cpu()
            start = t["input_ids"].shape[1] - logp.shape[1]
            for i, row in enumerate(batch):
                for j in range(start, len(row)):
                    if row.loss_mask[j] and math.isnan(row.old_logprobs[j]):
                        row.old_logprobs[j] = float(logp[i, j - start])
            del t, logp
            self._release_step_memory()

    def save(self, out_dir: Path) -> None:
        """Write the adapter (vLLM/peft loadable), optimizer state and step count."""
        self.model.save_pretrained(str(out_dir))
        self._save_state(out_dir)

    def _save_state(self, out_dir: Path) -> None:
        """The optimizer state and step count beside the adapter."""
        torch.save(self.optimizer.state_dict(), Path(out_dir) / OPTIMIZER_FILE)
        (Path(out_dir) / STATE_FILE).write_text(json.dumps({"steps_done": self.steps_done,
                                                            "backend": self.backend}))
