"""Many adapters on one base: the models that share a base model and LoRA shape share one copy
of its weights in the trainer.

:class:`SharedBase` holds the frozen base as one peft model with a named LoRA adapter per
trained model; :class:`AdapterPolicy` is one model's policy on it (its adapter, optimizer state
and step count), used by a step exactly like a :class:`~.trainer.Trainer`. Every forward routes
each row to the adapter it trains (peft's mixed-batch LoRA forward, here with gradients), so
:func:`optimize_together` trains several models' rows in shared forward/backward passes over
the frozen base, each adapter's gradient coming from its own rows only.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ...core.config import LoraConfig, TrainConfig
from ..chat_template import apply_chat_template_override
from .rows import Row
from .trainer import (
    Rendering,
    Trainer,
    micro_batches,
    return_freed_memory,
    step_metrics,
    step_totals,
)

log = logging.getLogger(__name__)


def _route(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], adapter_names: list[str]
           ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Forward pre-hook of a LoRA layer: each row of the batch goes through its own adapter."""
    kwargs["adapter_names"] = adapter_names
    return args, kwargs


class SharedBase(Rendering):
    """One base model in memory and the LoRA adapters of the models trained on it."""

    def __init__(self, model_path: Path, lora: LoraConfig, device: str | None = None,
                 chat_template: str | None = None) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        apply_chat_template_override(self.tokenizer, chat_template)
        self.lora = lora
        base = AutoModelForCausalLM.from_pretrained(model_path, dtype=self.dtype)
        self._base: Any = base.to(self.device)  # type: ignore[arg-type]
        self.model: Any = None  # the peft model, once the first adapter is attached
        self.policies: dict[str, AdapterPolicy] = {}
        self._names = itertools.count()

    def attach(self, adapter_path: Path | None) -> AdapterPolicy:
        """A new policy on this base: a fresh adapter, or the checkpoint at ``adapter_path``
        (adapter and optimizer state)."""
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model

        name = f"a{next(self._names)}"
        config = PeftLoraConfig(r=self.lora.r, lora_alpha=self.lora.alpha,
                                lora_dropout=self.lora.dropout,
                                target_modules=list(self.lora.target_modules),
                                task_type="CAUSAL_LM")
        if self.model is None:
            self.model = get_peft_model(self._base, config, adapter_name=name)
        else:
            self.model.add_adapter(name, config)
        policy = AdapterPolicy(self, name)
        # peft leaves only its active adapter trainable: each policy's own are
        for p in policy.trainable_parameters():
            p.requires_grad_(True)
        try:
            policy._start(adapter_path)
        except BaseException:
            self.model.delete_adapter(name)
            raise
        self.policies[name] = policy
        return policy

    def detach(self, policy: AdapterPolicy) -> None:
        """Drop ``policy``'s adapter; the base goes with its last one."""
        if self.policies.pop(policy.adapter_name, None) is None:
            return
        if not self.policies:
            self.model = self._base = None
            return
        with warnings.catch_warnings():  # "adapter aN was active, now deleted": none is
            warnings.simplefilter("ignore", UserWarning)  # rows name their adapter
            self.model.delete_adapter(policy.adapter_name)
        for p in self.policies.values():  # delete_adapter re-activates (and freezes) others
            for param in p.trainable_parameters():
                param.requires_grad_(True)

    @property
    def closed(self) -> bool:
        return self.model is None and self._base is None

    @contextlib.contextmanager
    def routed(self, adapter_names: list[str]) -> Iterator[None]:
        """Forwards inside run row ``i`` through adapter ``adapter_names[i]``."""
        from peft.tuners.lora import LoraLayer

        hook = functools.partial(_route, adapter_names=adapter_names)
        handles = [m.register_forward_pre_hook(hook, with_kwargs=True)
                   for m in self.model.modules()
                   if isinstance(m, LoraLayer) and isinstance(m, torch.nn.Module)]
        try:
            yield
        finally:
            for h in handles:
                h.remove()


class AdapterPolicy(Trainer):
    """One trained model's policy on a :class:`SharedBase`: its adapter, optimizer and step
    count; the base weights are the shared ones."""

    def __init__(self, shared: SharedBase, adapter_name: str) -> None:
        # no Trainer.__init__: the base is loaded once, by the SharedBase
        self.shared, self.adapter_name = shared, adapter_name
        self.device, self.dtype = shared.device, shared.dtype
        self.tokenizer, self.lora = shared.tokenizer, shared.lora
        self.backend = "peft"
        self.model = shared.model

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """This adapter's LoRA weights (peft's ``...lora_A.<adapter>.weight``), in the model's
        order, as a one-adapter Trainer's (checkpoints are interchangeable)."""
        out = []
        for name, param in self.model.named_parameters():
            parts = name.split(".")
            if any(parts[i].startswith("lora_") and parts[i + 1] == self.adapter_name
                   for i in range(len(parts) - 1)):
                out.append(param)
        return out

    def _tensors(self, batch: list[Row]) -> dict[str, torch.Tensor]:
        t = super()._tensors(batch)
        # which adapter each row trains: its own (several models' rows) or this policy's
        t["adapters"] = torch.tensor([int((r.adapter or self.adapter_name)[1:]) for r in batch])
        return t

    def _logits(self, t: dict[str, torch.Tensor]) -> torch.Tensor:
        names = [f"a{i}" for i in t["adapters"].tolist()]
        with self.shared.routed(names):
            return super()._logits(t)

    def save(self, out_dir: Path) -> None:
        """The checkpoint a one-adapter Trainer writes: the adapter at the folder's top."""
        out_dir = Path(out_dir)
        self.model.save_pretrained(str(out_dir), selected_adapters=[self.adapter_name])
        nested = out_dir / self.adapter_name  # peft puts a non-"default" adapter in a subfolder
        for f in nested.iterdir():
            f.replace(out_dir / f.name)
        shutil.rmtree(nested)
        super()._save_state(out_dir)

    def close(self) -> None:
        """Drop this adapter from the shared base (the model resumes from its checkpoint)."""
        self.shared.detach(self)


def optimize_together(policies: list[AdapterPolicy], rows: list[list[Row]], config: TrainConfig,
                      mixed: bool = False) -> list[dict[str, float]]:
    """One step of each policy (all on one base) on its ``rows``, their rows in shared
    forward/backward passes; each policy's update is the one of training it alone.

    ``mixed``: micro-batches mix rows of different adapters (routed per row); else (the
    default, measured faster on CPU: ``benchmarks/many_adapters.py``) each micro-batch holds
    one adapter's rows. Returns each policy's step metrics.
    """
    shared = policies[0].shared
    if any(p.shared is not shared for p in policies) or len(set(map(id, policies))) < len(
            policies):
        raise ValueError("optimize_together trains distinct policies of one shared base")
    try:
        for policy, own in zip(policies, rows, strict=True):
            for row in own:
                row.adapter = policy.adapter_name
        if mixed:
            batches = micro_batches([r for own in rows for r in own], config.micro_batch_tokens)
        else:
            batches = [b for own in rows for b in micro_batches(own, config.micro_batch_tokens)]
        totals = [step_totals([b for b in ([r for r in batch if r.adapter == p.adapter_name]
                                           for batch in batches) if b]) for p in policies]
        for policy in policies:
            policy.prepare(config)
        lead = policies[0]
        lead._fill_old_logprobs(batches)
        key = "trained_tokens" if config.loss_normalization == "token" else "rows"
        normalizers = {p.adapter_name: tot[key] for p, tot in zip(policies, totals, strict=True)}
        grad_norms = [0.0] * len(policies)
        sums: dict[str, dict[str, float]] = {}
        for epoch in range(config.num_epochs):  # metrics describe the first pass
            for policy in policies:
                policy.optimizer.zero_grad(set_to_none=True)
            epoch_sums = lead.backward_by_adapter(batches, config, normalizers,
                                                  collect=epoch == 0)
            sums = sums or epoch_sums
            for i, policy in enumerate(policies):
                if config.max_grad_norm is not None:
                    grad_norms[i] = policy._clip_grad_norm(config.max_grad_norm)
                policy.optimizer.step()
        for policy in policies:
            policy.steps_done += 1
        return [step_metrics(sums[p.adapter_name], tot, norm, config)
                for p, tot, norm in zip(policies, totals, grad_norms, strict=True)]
    finally:
        for own in rows:
            for row in own:
                row.adapter = ""
        if shared.device.type == "cpu":
            return_freed_memory()
        elif shared.device.type == "cuda":
            torch.cuda.empty_cache()
