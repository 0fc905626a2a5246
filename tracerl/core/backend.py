"""The backend contract: what every backend (local, remote, or a plugin's own) implements.

A backend serves registered models for inference, records their calls and trains them. It is
given :class:`~tracerl.core.model_spec.ModelSpec` objects (or the user's model handle, whose
``spec`` it reads with :func:`~tracerl.core.model_spec.spec_of`), and
reports a training step as :class:`TrainEvent` objects from :meth:`Backend.train_events`; its
caller fires the lifecycle hooks from them (:mod:`tracerl.events.lifecycle`). Core fires no
hooks: :meth:`Backend.train` hands each event to the observers of :func:`observe_training`,
which the event layer subscribes to.

:meth:`Backend.train` is ART 0.5's ``await backend.train(model, groups, **kwargs)``: the same step
with ART's keyword arguments, returning a :class:`TrainResult`; like ART's, it does not log.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from .art_compat import train_config_from_art_kwargs
from .config import TrainConfig, TrainSFTConfig
from .errors import (
    ConfigError,
    InvalidTrajectoryError,
    StepsFailedError,
    TracerlError,
    TrainingError,
)
from .model_spec import ModelLike, ModelSpec, spec_of
from .spans import Span
from .trajectory import LLMCall, Trajectory, TrajectoryGroup, attach_scoped_calls

log = logging.getLogger(__name__)


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


@dataclass
class TrainResult:
    """What ``await backend.train(...)`` returns (ART's ``TrainResult``): the step the model is
    at after training, and the step's training metrics."""

    step: int
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class LocalTrainResult(TrainResult):
    """``LocalBackend.train``'s result (ART's ``LocalTrainResult``): with the checkpoint."""

    checkpoint_path: str | None = None


TrainObserver = Callable[[ModelSpec, TrainEvent, list[TrajectoryGroup], TrainConfig],
                         Awaitable[None]]
_train_observers: list[TrainObserver] = []


def observe_training(observer: TrainObserver) -> None:
    """Await ``observer(model, event, groups, config)`` for each event of a step trained by
    :meth:`Backend.train` (ART's call; ``model.train`` fires its hooks itself). The event layer
    subscribes here (:mod:`tracerl.events`) to fire the training hooks."""
    if observer not in _train_observers:
        _train_observers.append(observer)


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
    def train_events(self, model: ModelLike, groups: list[TrajectoryGroup], config: TrainConfig
                     ) -> AsyncIterator[TrainEvent]:
        """Train one step on ``groups``: ``started``, any ``heartbeat``, then ``done``."""

    async def train(self, model: ModelLike, trajectory_groups: Iterable[TrajectoryGroup],
                    *args: Any, **kwargs: Any) -> TrainResult:
        """ART 0.5's ``await backend.train(model, groups, learning_rate=..., ...)``: one step,
        ART's keyword arguments translated by
        :func:`~tracerl.core.art_compat.train_config_from_art_kwargs` (those without an
        equivalent raise :class:`ConfigError` naming them). It logs nothing (as in ART): log with
        ``await model.log(groups, metrics=result.metrics, step=result.step, split="train")``.
        No groups (e.g. RULER swallowed every judge failure) skip the step, as ART does."""
        if args:
            raise ConfigError(
                f"backend.train(model, groups, ...) takes ART's keyword arguments, not a "
                f"positional {type(args[0]).__name__}: write `await backend.train(model, groups, "
                "learning_rate=...)`, or keep the config with `await model.train(groups, "
                "config=TrainConfig(...))`")
        config = train_config_from_art_kwargs(kwargs)
        groups = list(trajectory_groups)
        for i, g in enumerate(groups):
            if not isinstance(g, TrajectoryGroup):
                raise InvalidTrajectoryError(
                    f"backend.train: item {i} is a {type(g).__name__}, not a TrajectoryGroup; "
                    "did you forget to await gather_trajectory_groups(...)?")
        if not groups:
            log.warning("Skipping tuning as there is no suitable data (no trajectory groups: "
                        "e.g. every group was dropped by a failing judge); the step still "
                        "advances, as in ART")
        await attach_scoped_calls(groups)
        spec = spec_of(model)
        result = TrainResult(step=0)
        async for event in self.train_events(spec, groups, config):
            for observer in _train_observers:
                await observer(spec, event, groups, config)
            if event.kind == "done":
                result = TrainResult(step=event.step, metrics=dict(event.metrics))
        return result

    def check_groups(self, model: ModelLike, groups: list[TrajectoryGroup]) -> None:
        """Raise :class:`InvalidTrajectoryError` naming the first row of ``groups`` that
        ``model`` cannot train on (a token id outside its vocabulary, a reward beyond
        ``±MAX_REWARD``, ...); nothing is queued or written. This default checks nothing (the
        step does)."""
        del model, groups

    async def check_rows(self, model: ModelLike, groups: list[TrajectoryGroup]) -> None:
        """:meth:`check_groups`, for a backend that must ask elsewhere (a remote server)."""
        self.check_groups(model, groups)

    async def train_many(self, groups: Mapping[ModelLike, Iterable[TrajectoryGroup]],
                         config: TrainConfig | None = None) -> dict[ModelLike, TrainResult]:
        """One step of each model on its groups: ``await backend.train_many({planner:
        groups_a, executor: groups_b}, config=TrainConfig(...))``. A model without groups takes
        no step (so that ``{m: await backend.pending_groups(m) for m in models}`` after a crash
        trains each model's saved groups once). Returns each model's result, keyed as given.
        The local backend trains models that share a base in shared passes; this default trains
        them one after another.

        Every model's rows are checked (:meth:`check_rows`) before any model trains: a model
        whose rows it cannot train on takes no step and writes nothing, the healthy ones train,
        then :class:`StepsFailedError` names each failed model and its field (``failed``) and
        carries the trained models' results (``results``), so a retry trains only the failed."""
        config = config or TrainConfig()
        todo: dict[str, tuple[ModelLike, ModelSpec, list[TrajectoryGroup]]] = {}
        for model, model_groups in groups.items():
            spec, listed = spec_of(model), list(model_groups)
            if spec.key in todo:
                raise ConfigError(f"train_many: model {spec.key} is given twice")
            for i, g in enumerate(listed):
                if not isinstance(g, TrajectoryGroup):
                    raise InvalidTrajectoryError(
                        f"train_many: item {i} of {spec.key} is a {type(g).__name__}, not a "
                        "TrajectoryGroup")
            if listed:
                todo[spec.key] = (model, spec, listed)
        failed = await self._refused_rows(todo)
        results: dict[ModelLike, TrainResult] = {}
        for _, _, listed in todo.values():
            await attach_scoped_calls(listed)
        try:
            async for key, event in self.train_many_events(
                    [(spec, listed) for _, spec, listed in todo.values()], config):
                model, spec, listed = todo[key]
                for observer in _train_observers:
                    await observer(spec, event, listed, config)
                if event.kind == "done":
                    results[model] = TrainResult(step=event.step, metrics=dict(event.metrics))
        except StepsFailedError as e:
            failed.update(e.failed)
        if failed:
            raise StepsFailedError(failed, results)
        return results

    async def _refused_rows(self, todo: dict[str, tuple[ModelLike, ModelSpec,
                                                          list[TrajectoryGroup]]]
                            ) -> dict[str, BaseException]:
        """Check every model's rows; the refused models leave ``todo``, their errors (naming
        the model and the field) are returned."""
        failed: dict[str, BaseException] = {}
        for key, (_, spec, listed) in list(todo.items()):
            try:
                await self.check_rows(spec, listed)
            except InvalidTrajectoryError as e:
                failed[key] = InvalidTrajectoryError(f"train_many: model {key}: {e}")
                del todo[key]
        return failed

    async def train_many_events(self, groups: list[tuple[ModelSpec, list[TrajectoryGroup]]],
                                config: TrainConfig) -> AsyncIterator[tuple[str, TrainEvent]]:
        """:meth:`train_many`'s events, each with its model's key (models one after another
        here; a model whose step fails does not stop the others: :class:`StepsFailedError` at
        the end names it)."""
        failed: dict[str, BaseException] = {}
        for spec, listed in groups:
            try:
                async for event in self.train_events(spec, listed, config):
                    yield spec.key, event
            except TracerlError as e:
                log.warning("train_many: the step of %s failed: %s", spec.key, e)
                failed[spec.key] = e
        if failed:
            raise StepsFailedError(failed)

    async def train_sft(self, model: ModelLike, trajectories: list[Trajectory],
                        config: TrainSFTConfig) -> TrainResult:
        """One supervised fine-tuning step on whole conversations (a new checkpoint)."""
        raise TrainingError(f"{type(self).__name__} has no supervised fine-tuning; train_sft "
                            "runs on a LocalBackend")

    @abstractmethod
    async def log(self, model: ModelLike, groups: list[TrajectoryGroup], split: str,
                  step: int, metrics: dict[str, float]) -> None:
        """Persist a step's trajectories and metrics."""

    @abstractmethod
    async def fetch_calls(self, model: ModelLike, rollout_id: str) -> list[LLMCall]:
        """The LLM calls the gateway recorded for ``rollout_id``."""

    async def fetch_spans(self, model: ModelLike, rollout_id: str) -> list[Span]:
        """The spans posted to the gateway for ``rollout_id`` (``POST /v1/rollouts/{id}/spans``,
        e.g. by the LiteLLM proxy's callback); none where the backend keeps no spans."""
        del model, rollout_id
        return []

    async def take_external_groups(self, model: ModelLike, n_groups: int, request_id: str
                                   ) -> list[TrajectoryGroup]:
        """``n_groups`` groups of rollouts that a service outside this process opened and
        finished through the gateway's rollout API, or none while fewer are ready. Each
        rollout is handed out once; the same ``request_id`` again returns the same groups
        (a retried request)."""
        raise TrainingError(f"{type(self).__name__} has no rollout API for outside services")

    async def external_rollouts_status(self, model: ModelLike) -> dict[str, int]:
        """Counts of the rollout API's rollouts: ``open``, ``finished`` (not handed out yet),
        ``ready_groups``, ``handed_out``."""
        raise TrainingError(f"{type(self).__name__} has no rollout API for outside services")

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

    def __enter__(self) -> Backend:
        """``with LocalBackend() as backend:`` (ART's sync form) closes it on exit as well."""
        return self

    def __exit__(self, *exc: object) -> None:
        _run_to_end(self.close())

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _run_to_end(coro: Coroutine[Any, Any, None]) -> None:
    """Run ``coro`` to its end from sync code: here, or on a thread of its own when this thread
    already runs an event loop (a ``with`` block inside async code)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        asyncio.run(coro)
        return
    failure: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(coro)
        except BaseException as e:  # re-raised in the caller's thread
            failure.append(e)

    thread = threading.Thread(target=run, name="tracerl-backend-close")
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
