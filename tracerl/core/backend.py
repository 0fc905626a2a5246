"""The interface every backend implements (local, remote, or a plugin's own)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from .config import TrainConfig
    from ..rollout.model import Model
    from .trajectory import LLMCall, TrajectoryGroup


@dataclass(frozen=True)
class InferenceEndpoint:
    """Where a registered model is served (an OpenAI-compatible base URL)."""

    base_url: str
    api_key: str
    model_name: str


class Backend(ABC):
    """Serves models for inference, records their calls and trains them."""

    name: ClassVar[str]

    @abstractmethod
    async def register(self, model: Model) -> InferenceEndpoint:
        """Prepare ``model`` (folders, engine, latest checkpoint) and say where it is served."""

    @abstractmethod
    async def get_step(self, model: Model) -> int:
        """The step of the newest complete checkpoint (0 before any training)."""

    @abstractmethod
    def train(self, model: Model, groups: list[TrajectoryGroup], config: TrainConfig
              ) -> AsyncIterator[dict[str, float]]:
        """Train one step on ``groups``; yields progress, and last the step's metrics."""

    @abstractmethod
    async def log(self, model: Model, groups: list[TrajectoryGroup], split: str,
                  step: int, metrics: dict[str, float]) -> None:
        """Persist a step's trajectories and metrics."""

    @abstractmethod
    async def fetch_calls(self, model: Model, rollout_id: str) -> list[LLMCall]:
        """The LLM calls the gateway recorded for ``rollout_id``."""

    @abstractmethod
    async def history(self, model: Model) -> list[dict[str, Any]]:
        """The model's history.jsonl records."""

    @abstractmethod
    async def delete_checkpoints(self, model: Model, keep_steps: set[int]) -> list[int]:
        """Delete every checkpoint not in ``keep_steps``; returns what was deleted."""

    async def close(self) -> None:  # noqa: B027 - optional
        """Release engines, servers and threads."""

    async def __aenter__(self) -> Backend:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
