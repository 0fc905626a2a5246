"""Asynchronous off-policy training: rollouts keep running while the trainer trains.

Rollout workers turn scenarios into trajectory groups; the trainer takes ``groups_per_step`` of
them per step. Each recorded call names the policy version (adapter step) that sampled it; a
group's version is its oldest call's (the version current when it started, if it made none).

Staleness, chosen and bounded in two ways:

- admission: group number ``i`` starts only once the policy has reached
  ``start + i // groups_per_step - max_steps_off_policy``, so rollouts run at most
  ``max_steps_off_policy`` steps ahead of the trainer. With a bound of 0 this *is* the
  synchronous loop (sample a step's groups, train, sample the next ones).
- at training: a group more than ``max_steps_off_policy`` versions behind the policy being
  trained is dropped (it counts in ``TrainedStep.dropped_stale``), never trained on.

Groups within the bound are trained with the importance-sampling correction the GRPO loss
already applies: the ratio of the current policy to the *recorded* sampling logprobs of each
token, clipped to ``[1 - epsilon, 1 + epsilon_high]`` (PPO/GRPO's clipped surrogate). With
versions resident on the servers (``EngineConfig.resident_adapters >= max_steps_off_policy +
1``) a multi-turn rollout finishes on the version it started with.

:class:`PipelineTrainer` mirrors ART 0.5's (``model, backend, rollout_fn, scenarios, config,
eval_fn, max_steps_off_policy=4``); :meth:`RolloutPipeline.steps` is the async iterator of
trained steps under it, for custom loops. ``model.train`` (the synchronous loop) is unchanged.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, TypeVar, cast

from ..core.config import TrainConfig
from ..core.errors import ConfigError, NotRegisteredError
from ..core.trajectory import Trajectory, TrajectoryGroup

if TYPE_CHECKING:
    from ..core.backend import Backend
    from .model import TrainableModel

log = logging.getLogger(__name__)

T = TypeVar("T")
ScenarioT = TypeVar("ScenarioT")
ConfigT = TypeVar("ConfigT")
RolloutFn = Callable[["TrainableModel", ScenarioT, ConfigT], Awaitable[TrajectoryGroup]]
EvalFn = Callable[["TrainableModel", int, ConfigT], Awaitable[list[Trajectory | TrajectoryGroup]]]


class _Done(enum.Enum):
    DONE = enum.auto()


_DONE = _Done.DONE


def group_policy_version(group: TrajectoryGroup, started: int) -> int:
    """The oldest policy version that sampled any call of ``group`` (``started``, the version
    current when the group began, if no call names one)."""
    steps = [call.adapter_step for t in group.trajectories for call in t.llm_calls
             if call.adapter_step is not None]
    return min(steps, default=started)


@dataclass(frozen=True)
class TrainedStep:
    """One step the pipeline trained: its groups, metrics and how far off-policy they were."""

    step: int
    groups: list[TrajectoryGroup]
    metrics: dict[str, float]
    dropped_stale: int = 0
    steps_off_policy: list[int] = field(default_factory=list)  # per trained group


class RolloutPipeline(Generic[ScenarioT, ConfigT]):
    """Rollout workers feeding a trainer; iterate :meth:`steps` to drive it."""

    def __init__(self, model: TrainableModel, rollout_fn: RolloutFn[ScenarioT, ConfigT],
                 scenarios: Iterable[ScenarioT] | AsyncIterator[ScenarioT],
                 config: ConfigT | None = None, *, groups_per_step: int = 4,
                 max_steps_off_policy: int = 4, num_rollout_workers: int | None = None,
                 train_config: TrainConfig | None = None) -> None:
        if groups_per_step < 1:
            raise ConfigError("groups_per_step must be >= 1")
        if max_steps_off_policy < 0:
            raise ConfigError("max_steps_off_policy must be >= 0")
        if num_rollout_workers is not None and num_rollout_workers < 1:
            raise ConfigError("num_rollout_workers must be >= 1")
        if model.spec.config.engine.sleep_during_training:
            raise ConfigError("the async pipeline samples while the trainer trains: the servers "
                              "must stay awake (EngineConfig(sleep_during_training=False))")
        resident = model.spec.config.engine.resident_adapters
        if resident < max_steps_off_policy + 1:
            log.warning("%s keeps %d policy version(s) loaded; with max_steps_off_policy=%d, "
                        "multi-turn rollouts may change versions midway (their group then "
                        "counts from its oldest call): set EngineConfig(resident_adapters=%d)",
                        model.name, resident, max_steps_off_policy, max_steps_off_policy + 1)
        self.model, self.rollout_fn, self.config = model, rollout_fn, config
        self.groups_per_step = groups_per_step
        self.max_steps_off_policy = max_steps_off_policy
        self.num_rollout_workers = num_rollout_workers or groups_per_step * (
            max_steps_off_policy + 1)
        self.train_config = train_config or TrainConfig()
        self._scenarios = scenarios
        self._policy = 0
        self._start = 0
        self._admitted = 0
        self._changed = asyncio.Condition()
        self._queue: asyncio.Queue[tuple[TrajectoryGroup, int] | Exception | _Done] = (
            asyncio.Queue())

    def _may_start(self) -> bool:
        due = self._start + self._admitted // self.groups_per_step  # the step it will train
        return self._policy >= due - self.max_steps_off_policy

    async def _next_scenario(self, scenarios: AsyncIterator[ScenarioT]) -> ScenarioT | _Done:
        async with self._changed:
            await self._changed.wait_for(self._may_start)
            try:
                scenario = await anext(scenarios)
            except StopAsyncIteration:
                return _DONE
            self._admitted += 1
            return scenario

    async def _worker(self, scenarios: AsyncIterator[ScenarioT]) -> None:
        while (scenario := await self._next_scenario(scenarios)) is not _DONE:
            started = self._policy
            try:
                # config None (not given): the rollout_fn takes None where it takes a config
                group = await self.rollout_fn(self.model, scenario, cast(ConfigT, self.config))
            except Exception as e:  # the trainer raises it
                await self._queue.put(e)
                return
            if not isinstance(group, TrajectoryGroup):
                await self._queue.put(ConfigError(
                    f"rollout_fn must return a TrajectoryGroup, got {type(group).__name__}"))
                return
            await self._queue.put((group, group_policy_version(group, started)))
        await self._queue.put(_DONE)

    async def steps(self, max_steps: int | None = None) -> AsyncIterator[TrainedStep]:
        """Train until the scenarios run out (or ``max_steps``), yielding each trained step."""
        self._start = self._policy = await self.model.get_step()
        scenarios = _aiter(self._scenarios)
        workers = [asyncio.create_task(self._worker(scenarios))
                   for _ in range(self.num_rollout_workers)]
        finished, trained = 0, 0
        try:
            while max_steps is None or trained < max_steps:
                batch: list[TrajectoryGroup] = []
                lags: list[int] = []
                dropped = 0
                while len(batch) < self.groups_per_step and finished < len(workers):
                    item = await self._queue.get()
                    if item is _DONE:
                        finished += 1
                        continue
                    if isinstance(item, BaseException):
                        raise item
                    group, version = item
                    lag = self._policy - version
                    if lag > self.max_steps_off_policy:
                        dropped += 1
                        log.info("dropped a group %d versions behind (bound %d)", lag,
                                 self.max_steps_off_policy)
                        continue
                    group.metadata["policy_version"] = version
                    batch.append(group)
                    lags.append(lag)
                if not batch:
                    return
                metrics = await self.model.train(batch, self.train_config)
                step = await self.model.get_step()
                async with self._changed:
                    self._policy = step
                    self._changed.notify_all()
                trained += 1
                yield TrainedStep(step, batch, {**metrics, "dropped_stale": float(dropped),
                                                "steps_off_policy_max": float(max(lags))},
                                  dropped, lags)
        finally:
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)


def _aiter(items: Iterable[T] | AsyncIterator[T]) -> AsyncIterator[T]:
    if isinstance(items, AsyncIterator):
        return items

    async def gen() -> AsyncIterator[T]:
        for item in items:
            yield item

    return gen()


class PipelineTrainer(Generic[ScenarioT, ConfigT]):
    """ART 0.5's ``PipelineTrainer``: rollouts, training and evaluation overlapped.

    ``rollout_fn(model, scenario, config)`` returns one TrajectoryGroup; ``eval_fn(model, step,
    config)`` returns trajectories or groups, logged as the ``val`` split every
    ``eval_every_n_steps`` steps (and before the first if ``eval_at_start``)."""

    def __init__(self, model: TrainableModel, backend: Backend,
                 rollout_fn: RolloutFn[ScenarioT, ConfigT],
                 scenarios: Iterable[ScenarioT] | AsyncIterator[ScenarioT], config: ConfigT,
                 eval_fn: EvalFn[ConfigT] | None = None, *, groups_per_step: int = 4,
                 num_rollout_workers: int | None = None, learning_rate: float = 1e-5,
                 train_config: TrainConfig | None = None, max_steps: int | None = None,
                 max_steps_off_policy: int = 4, eval_every_n_steps: int = 20,
                 eval_at_start: bool = True) -> None:
        if max_steps is not None and max_steps < 0:
            raise ConfigError("max_steps must be >= 0")
        if eval_every_n_steps < 0:
            raise ConfigError("eval_every_n_steps must be >= 0")
        self.model, self.backend, self.config, self.eval_fn = model, backend, config, eval_fn
        self.max_steps = max_steps
        self.eval_every_n_steps, self.eval_at_start = eval_every_n_steps, eval_at_start
        self.pipeline: RolloutPipeline[ScenarioT, ConfigT] = RolloutPipeline(
            model, rollout_fn, scenarios, config, groups_per_step=groups_per_step,
            max_steps_off_policy=max_steps_off_policy, num_rollout_workers=num_rollout_workers,
            train_config=train_config or TrainConfig(learning_rate=learning_rate))
        self.trained: list[TrainedStep] = []

    async def _eval(self, step: int) -> None:
        if self.eval_fn is not None:
            results = await self.eval_fn(self.model, step, self.config)
            if results:
                await self.model.log(results, split="val")

    async def train(self) -> list[TrainedStep]:
        """Run the pipeline to the end of the scenarios (or ``max_steps``)."""
        if getattr(self.model, "_backend", None) is None:
            await self.model.register(self.backend)
        elif self.model.backend is not self.backend:
            raise NotRegisteredError(f"model {self.model.name} is registered with another "
                                     "backend than the one given")
        if self.eval_at_start:
            await self._eval(await self.model.get_step())
        async for trained in self.pipeline.steps(self.max_steps):
            self.trained.append(trained)
            if self.eval_every_n_steps and len(self.trained) % self.eval_every_n_steps == 0:
                await self._eval(trained.step)
        return self.trained
