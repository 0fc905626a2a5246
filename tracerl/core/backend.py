"""The backend contract: what every backend (local, remote, or a plugin's own) implements.

A backend serves registered models for inference, records their calls and trains them. It is
given :class:`~tracerl.core.model_spec.ModelSpec` objects (or the user's model handle, whose
``spec`` it reads with :func:`~tracerl.core.model_spec.spec_of`), and
reports a training step as :class:`TrainEvent` objects; the caller of :meth:`Backend.train`
fires the lifecycle hooks from them (:mod:`tracerl.core.lifecycle`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from .config import TrainConfig
from .model_spec import ModelLike
from .trajectory import LLMCall, TrajectoryGroup


@dataclass(frozen=True)
class InferenceEndpoint:
    """Where a registered model is served (an OpenAI-compatible base URL)."""

    base_url: str
    api_key: str
    model_name: str


@dataclass(frozen=True)
class TrainEvent:
    """Progress of one training step.

    ``started``: the step's trajectories are on disk and training begins. ``heartbeat``: still
    running after ``elapsed_s``. ``done``: the checkpoint of ``step`` is saved and served;
    ``metrics`` are the step's.
    """

    kind: Literal["started", "heartbeat", "done"]
    step: int
    metrics: dict[str, float] = field(default_factory=dict)
    elapsed_s: float = 0.0


class Backend(ABC):
    """Serves models for inference, records their calls and trains them."""

    name: ClassVar[str]

    @abstractmethod
    async def register(self, model: ModelLike) -> InferenceEndpoint:
        """Prepare ``model`` (folders, engine, latest checkpoint) and say where it is served."""

    @abstractmethod
    async def get_step(self, model: ModelLike) -> int:
        """The step of the newest complete checkpoint (0 before any training)."""

    @abstractmethod
    def train(self, model: ModelLike, groups: list[TrajectoryGroup], config: TrainConfig
              ) -> AsyncIterator[TrainEvent]:
        """Train one step on ``groups``: ``started``, any ``heartbeat``, then ``done``."""

    @abstractmethod
    async def log(self, model: ModelLike, groups: list[TrajectoryGroup], split: str,
                  step: int, metrics: dict[str, float]) -> None:
        """Persist a step's trajectories and metrics."""

    @abstractmethod
    async def fetch_calls(self, model: ModelLike, rollout_id: str) -> list[LLMCall]:
        """The LLM calls the gateway recorded for ``rollout_id``."""

    @abstractmethod
    async def history(self, model: ModelLike) -> list[dict[str, Any]]:
        """The model's history.jsonl records."""

    @abstractmethod
    async def delete_checkpoints(self, model: ModelLike, keep_steps: set[int]) -> list[int]:
        """Delete every checkpoint not in ``keep_steps``; returns what was deleted."""

    @abstractmethod
    async def pending_groups(self, model: ModelLike) -> list[TrajectoryGroup]:
        """Groups saved for a step whose training never finished (a crash), to train again."""

    async def close(self) -> None:  # noqa: B027 - optional
        """Release engines, servers and threads."""

    async def __aenter__(self) -> Backend:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
