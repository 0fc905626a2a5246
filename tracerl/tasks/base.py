"""What a task of the catalog is: items in two disjoint splits, a model configuration, and an
agent that plays one item as a rollout and scores it with its library's own scorer."""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from ..core.config import EngineConfig, LoraConfig, ModelConfig
from ..core.trajectory import Trajectory

Split = Literal["train", "test"]
SPLITS: tuple[Split, ...] = ("train", "test")
TEST_SHARE = 5  # one item in TEST_SHARE goes to the held-out split (by a hash of its content)
TASKS_EXTRA = "pip install 'tracerl[tasks]'"  # what installs the libraries of tracerl's tasks


def split_of(key: str) -> Split:
    """The split an item belongs to, by a hash of its identity: the held-out split never
    meets the training one, whatever seed or size either is drawn with."""
    digest = hashlib.sha256(key.encode()).digest()
    return "test" if digest[0] % TEST_SHARE == 0 else "train"


@dataclass(frozen=True)
class Item:
    """One problem of a task: ``key`` is its identity (what the split is decided by),
    ``data`` what the agent and the scorer need."""

    key: str
    data: dict[str, Any] = field(default_factory=dict)


Rollout = Callable[..., Awaitable[Trajectory]]


def lora_config_for(max_model_len: int, **engine: Any) -> Callable[[], ModelConfig]:
    """The catalog's model configuration: a rank-8 LoRA (alpha 16) served with
    ``max_model_len`` tokens of context; ``engine`` adds engine settings (a chat template, a
    tool-call parser)."""
    def model_config() -> ModelConfig:
        return ModelConfig(lora=LoraConfig(r=8, alpha=16),
                           engine=EngineConfig(max_model_len=max_model_len, **engine))
    return model_config


@dataclass(frozen=True)
class Task:
    """A task of the catalog.

    ``draw(seed, n)`` returns ``n`` candidate items (any split); :func:`items` keeps those of
    one split. ``rollout(model, item, temperature=..., step=...)`` plays one item with the
    task's agent and returns a trajectory whose ``metrics["success"]`` is the library's
    scorer's verdict (1.0 or 0.0) and whose reward is what training optimises. ``step`` pins
    the served version (``None``: the newest; ``0``: the base model). ``requires`` names the
    modules its agent and scorer import (their libraries imported only there), which
    :func:`~tracerl.tasks.get_task` checks, saying ``install`` when one is missing.
    """

    name: str
    summary: str
    source: str  # the library (and version) the items and the scorer come from
    framework: str  # the agent framework that runs the rollouts
    draw: Callable[[int, int], list[Item]]
    rollout: Rollout
    model_config: Callable[[], ModelConfig]
    group_size: int = 6  # rollouts per item in a training step
    items_per_step: int = 4
    learning_rate: float | Literal["auto"] = "auto"  # a task that needs its own says why
    requires: tuple[str, ...] = ()
    install: str = ""

    def items(self, split: Split, n: int, seed: int = 0) -> list[Item]:
        """``n`` distinct items of ``split`` (the held-out split is ``test``)."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, not {split!r}")
        seen: set[str] = set()
        out: list[Item] = []
        batch = max(4 * n, 32)
        for attempt in range(64):
            for item in self.draw(seed * 7919 + attempt, batch):
                if item.key not in seen and split_of(item.key) == split:
                    seen.add(item.key)
                    out.append(item)
                    if len(out) == n:
                        return out
        raise ValueError(f"task {self.name}: only {len(out)} distinct {split} items, not {n}")
