"""What online mode and release control ask of the backend that serves and trains the model:
two small typed interfaces, which :class:`~tracerl.backend.local.LocalBackend` satisfies
(online code never reaches into the backend's gateway).

- :class:`ReleaseBackend` (release control): the model's route (its routing, its versions,
  its store), the gateway's loop to change it on, and the gateway's address to replay calls
  through;
- :class:`OnlineBackend` (online mode) adds where training groups come from (live calls, the
  rollout API, the call store) and the trainer's step.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Coroutine
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    from ...core.backend import TrainEvent
    from ...core.config import TrainConfig
    from ...core.model_spec import ModelLike
    from ...core.storage import ModelStore
    from ...core.trajectory import LLMCall, TrajectoryGroup
    from ..gateway.recorder import CallStore
    from ..gateway.rollout_api import ExternalRollouts
    from ..gateway.served import ServedModel
    from .live_calls import LiveCalls

T = TypeVar("T")


class ReleaseBackend(Protocol):
    """What release control needs of the backend serving the model."""

    @property
    def api_key(self) -> str | None: ...

    @property
    def base_url(self) -> str:
        """The gateway's OpenAI base URL (shadow replays call it)."""
        ...

    def served(self, model: ModelLike) -> ServedModel:
        """The route of registered ``model``: its release routing, versions and store."""
        ...

    def inference_name(self, model: ModelLike) -> str: ...

    async def call_on_gateway(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the gateway's loop (where routes and engines live) and await it."""
        ...

    async def fetch_calls(self, model: ModelLike, rollout_id: str) -> list[LLMCall]: ...


class OnlineBackend(ReleaseBackend, Protocol):
    """What online mode needs of the backend besides: where its groups come from, and the
    trainer's step."""

    @property
    def live_calls(self) -> LiveCalls:
        """Online mode's live calls (the gateway records into them)."""
        ...

    @property
    def rollouts(self) -> ExternalRollouts:
        """The rollout API's rollouts."""
        ...

    @property
    def call_store(self) -> CallStore:
        """Where the gateway keeps recorded calls."""
        ...

    def store(self, model: ModelLike) -> ModelStore: ...

    async def take_external_groups(self, model: ModelLike, n_groups: int, request_id: str
                                   ) -> list[TrajectoryGroup]: ...

    async def train_from(self, model: ModelLike, step: int) -> None:
        """The model's next step trains from checkpoint ``step``, not its newest one."""
        ...

    def train_events(self, model: ModelLike, groups: list[TrajectoryGroup],
                     config: TrainConfig) -> AsyncIterator[TrainEvent]: ...
