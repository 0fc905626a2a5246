"""The trained policies a backend keeps in memory, one per trained model's folder.

A policy is loaded on its model's first step, from the newest checkpoint (or the one
:meth:`PolicyCache.start_from` names). Models of one base model, LoRA shape and chat template
share one copy of the base weights (:class:`~.training.adapters.SharedBase`); at most
``resident`` base weights stay loaded: one more first closes the least recently trained, whose
models later resume exactly from their newest checkpoints.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from ..core.config import DistributedTrainerConfig
from ..core.errors import ConfigError
from ..core.model_spec import ModelSpec
from ..core.storage import ModelStore
from .heap import freeze_long_lived_objects

if TYPE_CHECKING:
    from .training.adapters import SharedBase
    from .training.distributed import DistributedPolicy
    from .training.policy import Policy

log = logging.getLogger(__name__)


class PolicyCache:
    """Loaded policies by model folder (``str(store.root)``), least recently trained first."""

    def __init__(self, trainer: DistributedTrainerConfig | None, resident: int) -> None:
        if resident < 1:
            raise ConfigError(f"resident_policies must be at least 1, not {resident}")
        self.trainer = trainer  # None: this process trains; else torch.distributed ranks
        self.resident = resident
        self.loaded: dict[str, Policy | DistributedPolicy] = {}
        self.bases: dict[tuple[Path, str, str | None], SharedBase] = {}
        self.train_from: dict[str, int] = {}  # model folder -> its next step starts from

    def get(self, model: ModelSpec, store: ModelStore, model_path: Path
            ) -> Policy | DistributedPolicy:
        """The policy of ``model`` (stored in ``store``, its base weights at ``model_path``),
        loaded on first use: an adapter on the base it shares with the models of the same base
        and LoRA shape."""
        from .training.adapters import SharedBase
        from .training.distributed import start_distributed_policy
        from .training.trainer import Trainer, unsloth_usable

        key = str(store.root)
        if key in self.loaded:  # the most recently trained model goes last
            self.loaded[key] = self.loaded.pop(key)
            return self.loaded[key]
        start = self.train_from.pop(key, None)
        step = store.latest_step() if start is None else start
        checkpoint = store.checkpoint_dir(step) if step > 0 else None
        chat_template = model.config.engine.chat_template
        if self.trainer is not None:
            self.close_least_recent(len(self.holders()) + 1 - self.resident)
            self.loaded[key] = start_distributed_policy(
                self.trainer, model_path, model.config.lora, checkpoint, chat_template,
                store.root / "logs" / "trainer-ranks.log")
        elif unsloth_usable():  # pragma: no cover - GPU only; Unsloth patches its own model
            self.close_least_recent(len(self.holders()) + 1 - self.resident)
            self.loaded[key] = Trainer(model_path=model_path, lora=model.config.lora,
                                       adapter_path=checkpoint, chat_template=chat_template)
        else:
            base_key = (model_path, model.config.lora.model_dump_json(), chat_template)
            shared = self.bases.get(base_key)
            if shared is None or shared.closed:
                self.close_least_recent(len(self.holders()) + 1 - self.resident)
                shared = self.bases[base_key] = SharedBase(
                    model_path, model.config.lora, chat_template=chat_template)
            self.loaded[key] = shared.attach(checkpoint)
        return self.loaded[key]

    def holders(self) -> list[list[str]]:
        """The loaded policies' keys by what holds their base weights (a shared base, or a
        policy of its own), the least recently trained holder first."""
        holders: dict[int, list[str]] = {}
        for key, policy in self.loaded.items():  # least recently trained first
            holder = holders.setdefault(id(getattr(policy, "shared", policy)), [])
            holder.append(key)
        return sorted(holders.values(), key=lambda keys: list(self.loaded).index(keys[-1]))

    def close(self, key: str) -> None:
        """Close the policy of model folder ``key``, if loaded: it reloads from its newest
        checkpoint when it trains again."""
        policy = self.loaded.pop(key, None)
        if policy is not None:
            policy.close()
        self.bases = {k: b for k, b in self.bases.items() if not b.closed}

    def forget(self, key: str) -> None:
        """Drop the policy of ``key`` without closing it (its ranks are gone already)."""
        self.loaded.pop(key, None)

    def close_least_recent(self, count: int) -> None:
        """Close the policies of the ``count`` least recently trained base weights in memory
        and reclaim it (their models reload from their checkpoints when they train again)."""
        if count <= 0:
            return
        for keys in self.holders()[:count]:
            for key in keys:
                log.info("closing the policy of %s to keep %d in memory; it resumes from its "
                         "newest checkpoint when it trains again", key, self.resident)
                self.close(key)
        if not freeze_long_lived_objects():  # frozen or not, the closed policies are collected
            gc.collect()

    async def start_from(self, store: ModelStore, step: int) -> None:
        """The next step of the model in ``store`` starts from checkpoint ``step`` (0: the
        base model) instead of its newest one; its policy in memory, if any, is closed."""
        if step > 0 and step not in store.checkpoint_steps():
            raise ConfigError(f"{store.root.name} has no checkpoint {step} to train from")
        key = str(store.root)
        self.train_from[key] = step
        await asyncio.to_thread(self.close, key)

    async def close_all(self) -> None:
        for policy in self.loaded.values():
            await asyncio.to_thread(policy.close)
        self.loaded.clear()
        self.bases.clear()
