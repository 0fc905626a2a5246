"""Many adapters on one base: the models that share a base model and LoRA shape share one copy
of its weights in the trainer.

:class:`SharedBase` holds the frozen base as one peft model with a named LoRA adapter per
trained model; :class:`AdapterPolicy` is one model's :class:`~.policy.Policy` on it (its
adapter, optimizer state and step count), used by a step exactly like a
:class:`~.trainer.Trainer`. Every forward routes each row to the adapter it trains (peft's
mixed-batch LoRA forward, here with gradients), so :func:`optimize_together` (the one update,
``update.py``, of several policies) trains several models' rows in shared forward/backward
passes over the frozen base, each adapter's gradient coming from its own rows only.
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

from ...core.config import LoraConfig
from .policy import Policy, Rendering
from .rows import Row
from .trainer import load_base, load_tokenizer, peft_config, training_device
from .update import optimize

log = logging.getLogger(__name__)


def _route(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
           routing: list[list[str] | None]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Forward pre-hook of a LoRA layer: while ``routing[0]`` names an adapter per row, each
    row of the batch goes through its own adapter."""
    if routing[0] is not None:
        kwargs["adapter_names"] = routing[0]
    return args, kwargs


class SharedBase(Rendering):
    """One base model in memory and the LoRA adapters of the models trained on it."""

    def __init__(self, model_path: Path, lora: LoraConfig, device: str | None = None,
                 chat_template: str | None = None) -> None:
        self.device, self.dtype = training_device(device)
        self.tokenizer = load_tokenizer(model_path, chat_template)
        self.lora = lora
        self._base: Any = load_base(model_path, self.device, self.dtype)
        self.model: Any = None  # the peft model, once the first adapter is attached
        # the adapter of each row of the forwards running now (None: peft's active adapter),
        # read by a pre-hook on every LoRA layer; a list, so that the hooks hold no SharedBase
        self._routing: list[list[str] | None] = [None]
        self.policies: dict[str, AdapterPolicy] = {}
        self._names = itertools.count()

    def attach(self, adapter_path: Path | None) -> AdapterPolicy:
        """A new policy on this base: a fresh adapter, or the checkpoint at ``adapter_path``
        (adapter and optimizer state)."""
        from peft import get_peft_model

        name = f"a{next(self._names)}"
        if self.model is None:
            self.model = get_peft_model(self._base, peft_config(self.lora), adapter_name=name)
            self._install_routing()
        else:
            self.model.add_adapter(name, peft_config(self.lora))
        try:
            policy = AdapterPolicy(self, name, adapter_path)
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

    def _install_routing(self) -> None:
        """The routing pre-hook on every LoRA layer of the new peft model, for its lifetime
        (``add_adapter`` adds to these layers)."""
        from peft.tuners.lora import LoraLayer

        hook = functools.partial(_route, routing=self._routing)
        for m in self.model.modules():
            if isinstance(m, LoraLayer) and isinstance(m, torch.nn.Module):
                m.register_forward_pre_hook(hook, with_kwargs=True)

    @contextlib.contextmanager
    def routed(self, adapter_names: list[str] | None) -> Iterator[None]:
        """Forwards inside run row ``i`` through adapter ``adapter_names[i]`` (None: peft's
        active adapter)."""
        previous, self._routing[0] = self._routing[0], adapter_names
        try:
            yield
        finally:
            self._routing[0] = previous

    def recompute_context(self) -> tuple[Any, Any]:
        """torch checkpoint's ``context_fn`` (``checkpointing.apply``), called as a checkpointed
        layer's forward starts: the recompute of that layer in the backward pass, after
        :meth:`routed` has exited, routes each row to the adapter its forward did. Without it
        the recompute ran peft's unrouted LoRA forward, which saves other tensors (torch's
        CheckpointError: 79 saved in the forward, 58 in the recompute) and, routed to the
        active adapter, would give other rows' adapters wrong gradients."""
        return contextlib.nullcontext(), self.routed(self._routing[0])


def adapter_parameters(model: Any, adapter_name: str) -> list[torch.nn.Parameter]:
    """The LoRA weights of adapter ``adapter_name`` (peft's ``...lora_A.<adapter>.weight``),
    in the model's order, as a one-adapter Trainer's (checkpoints are interchangeable)."""
    out = []
    for name, param in model.named_parameters():
        parts = name.split(".")
        if any(parts[i].startswith("lora_") and parts[i + 1] == adapter_name
               for i in range(len(parts) - 1)):
            out.append(param)
    return out


class AdapterPolicy(Policy):
    """One trained model's policy on a :class:`SharedBase` (its adapter ``adapter_name``, from
    the checkpoint at ``adapter_path`` or fresh): its adapter, optimizer and step count; the
    base weights are the shared ones, and its forwards route each row to its adapter."""

    def __init__(self, shared: SharedBase, adapter_name: str, adapter_path: Path | None
                 ) -> None:
        self.shared = shared
        # peft leaves only its active adapter trainable: each policy's own are
        for p in adapter_parameters(shared.model, adapter_name):
            p.requires_grad_(True)
        super().__init__(shared.model, shared.tokenizer, shared.lora, device=shared.device,
                         dtype=shared.dtype, adapter_name=adapter_name, adapter_path=adapter_path)

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """This adapter's LoRA weights (:func:`adapter_parameters`)."""
        return adapter_parameters(self.model, self.adapter_name)

    def tensors(self, batch: list[Row]) -> dict[str, torch.Tensor]:
        t = super().tensors(batch)
        # which adapter each row trains: its own (several models' rows) or this policy's
        t["adapters"] = torch.tensor([int((r.adapter or self.adapter_name)[1:]) for r in batch])
        return t

    def logits(self, t: dict[str, torch.Tensor]) -> torch.Tensor:
        with self.shared.routed([f"a{i}" for i in t["adapters"].tolist()]):
            return super().logits(t)

    def hidden(self, t: dict[str, torch.Tensor]) -> torch.Tensor:
        with self.shared.routed([f"a{i}" for i in t["adapters"].tolist()]):
            return super().hidden(t)

    def recompute_context(self) -> tuple[Any, Any]:
        """A checkpointed layer's recompute routes rows as its forward did
        (:meth:`SharedBase.recompute_context`)."""
        return self.shared.recompute_context()

    def save(self, out_dir: Path) -> None:
        """The checkpoint a one-adapter Trainer writes: the adapter at the folder's top."""
        out_dir = Path(out_dir)
        self.model.save_pretrained(str(out_dir), selected_adapters=[self.adapter_name])
        nested = out_dir / self.adapter_name  # peft puts a non-"default" adapter in a subfolder
        for f in nested.iterdir():
            f.replace(out_dir / f.name)
        shutil.rmtree(nested)
        self.save_state(out_dir)

    def close(self) -> None:
        """Drop this adapter from the shared base (the model resumes from its checkpoint)."""
        self.shared.detach(self)


# one step of several policies of one shared base on their rows, in shared passes: the one
# update (update.optimize, which a model's own step runs too), under the name callers know
optimize_together = optimize
