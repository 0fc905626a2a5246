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

Dropping is biased: the groups that miss the bound are the slow ones (long, hard rollouts), so
training drifts toward what finishes fast. ``staleness="admit"`` (the default) keeps finished
work instead, in two parts:

- admission by staleness: a group started at version ``v`` must be trained from version
  ``v + max_steps_off_policy`` at the latest. A worker about to start a group estimates when it
  would finish (now + the longest of the last :data:`DURATION_WINDOW` groups' durations) and
  when that last batch closes (the last policy change + ``bound + 1`` mean step intervals - the
  mean training time); if it would finish too late, the group waits for the next policy change
  (where it has the most time), unless too few groups are running or waiting to fill the
  trainer's batch without it;
- pacing: the trainer does not close a batch while a running group is at its last chance (its
  version is ``policy - bound``); such groups, oldest first, are trained in this batch (which
  grows past ``groups_per_step`` if there are more of them). No finished group goes stale.

``staleness="drop"`` is the earlier behaviour: start whenever the run-ahead bound allows, take
finished groups in arrival order, drop those past the bound. Either way each step logs, under
the ``pipeline`` split at the trained step (``history.jsonl`` and the loggers), the lengths of
kept and dropped rollouts (``kept_rollout_tokens``, ``kept_rollout_s``, ``dropped_rollout_*``,
with ``kept_groups``, ``dropped_groups``, ``held_groups``, ``wait_s``), and the dropped groups
themselves under the ``dropped`` split (their calls are then no orphan calls).

When :meth:`RolloutPipeline.steps` ends (``max_steps`` reached, the scenarios run out, an
error, or the consumer leaves its ``async for`` by ``break`` or closes it), the rollouts running
ahead of the trainer are cancelled, not drained: their tasks are cancelled and awaited (up to
:data:`STOP_TIMEOUT_S`), and a gateway call whose client is cancelled stops in the engine too.
Finished groups not trained yet are left; the counts are logged. After a ``break`` the event
loop closes the generator soon after, not at once: ``async with contextlib.aclosing(
pipeline.steps()) as steps`` closes it on leaving the block, or await ``pipeline.stopped``.

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
import functools
import logging
from collections import Counter, deque
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, Literal, TypeVar, cast

from ..core.art_pipeline import (
    PipelineAutotuneConfig,
    PipelineRuntimeConfig,
    pipeline_options_from_art,
)
from ..core.config import DynamicSampling, TrainConfig
from ..core.errors import ConfigError, NotRegisteredError
from ..core.trajectory import Trajectory, TrajectoryGroup, attach_scoped_calls
from .sampling import DISCARDED_SPLIT, SamplingReport, log_sampling, verdict

if TYPE_CHECKING:
    from ..core.backend import Backend
    from .model import TrainableModel

log = logging.getLogger(__name__)

T = TypeVar("T")
ScenarioT = TypeVar("ScenarioT")
ConfigT = TypeVar("ConfigT")
RolloutFn = Callable[["TrainableModel", ScenarioT, ConfigT], Awaitable[TrajectoryGroup]]
EvalFn = Callable[["TrainableModel", int, ConfigT], Awaitable[list[Trajectory | TrajectoryGroup]]]
Staleness = Literal["admit", "drop"]
STALENESS: tuple[Staleness, ...] = ("admit", "drop")
DURATION_WINDOW = 32  # finished groups whose longest duration estimates a new group's
PACE_WINDOW = 8  # steps whose mean interval and training time estimate the pace
STOP_TIMEOUT_S = 30.0  # how long steps() waits, as it ends, for cancelled rollouts to unwind


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
class _Finished:
    """A finished group waiting for the trainer: its version and how long it ran."""

    group: TrajectoryGroup
    version: int
    seconds: float


def _tokens_per_rollout(group: TrajectoryGroup) -> float:
    n = len(group.trajectories)
    return sum(t.completion_tokens for t in group.trajectories) / n if n else 0.0


def _mean(xs: Iterable[float]) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else 0.0


@dataclass(frozen=True)
class TrainedStep:
    """One step the pipeline trained: its groups, metrics and how far off-policy they were."""

    step: int
    groups: list[TrajectoryGroup]
    metrics: dict[str, float]
    dropped_stale: int = 0
    steps_off_policy: list[int] = field(default_factory=list)  # per trained group
    discarded: int = 0  # groups set aside by dynamic sampling (equal rewards)


class RolloutPipeline(Generic[ScenarioT, ConfigT]):
    """Rollout workers feeding a trainer; iterate :meth:`steps` to drive it.

    ``staleness`` says what keeps groups within ``max_steps_off_policy``: ``"admit"`` (hold a
    group that would not finish in time until the next step, and pace the trainer so that no
    finished group goes stale) or ``"drop"`` (drop what went stale); see the module's doc.

    ``dynamic_sampling`` (off by default): a finished group without signal (equal rewards) is
    set aside, its admission slot given back so that another scenario starts in its place,
    until the batch has ``groups_per_step`` groups with signal or the step's bound is hit
    (``(max_draw_factor - 1) * groups_per_step`` groups set aside, or the trainer waited
    ``max_seconds``); past the bound such groups are trained (nothing learnt) so that the
    trainer moves on. Counts are logged under the ``sampling`` split (:mod:`.sampling`)."""

    def __init__(self, model: TrainableModel, rollout_fn: RolloutFn[ScenarioT, ConfigT],
                 scenarios: Iterable[ScenarioT] | AsyncIterator[ScenarioT],
                 config: ConfigT | None = None, *, groups_per_step: int = 4,
                 max_steps_off_policy: int = 4, num_rollout_workers: int | None = None,
                 train_config: TrainConfig | None = None,
                 staleness: Staleness = "admit",
                 dynamic_sampling: DynamicSampling | None = None) -> None:
        if groups_per_step < 1:
            raise ConfigError("groups_per_step must be >= 1")
        if max_steps_off_policy < 0:
            raise ConfigError("max_steps_off_policy must be >= 0")
        if num_rollout_workers is not None and num_rollout_workers < 1:
            raise ConfigError("num_rollout_workers must be >= 1")
        if staleness not in STALENESS:
            raise ConfigError(f"staleness must be one of {', '.join(STALENESS)}, "
                              f"got {staleness!r}")
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
        self.staleness: Staleness = staleness
        self.num_rollout_workers = num_rollout_workers or groups_per_step * (
            max_steps_off_policy + 1)
        self.train_config = train_config or TrainConfig()
        if dynamic_sampling is not None and dynamic_sampling.groups not in (None,
                                                                             groups_per_step):
            raise ConfigError(f"dynamic_sampling.groups must be None or the pipeline's "
                              f"groups_per_step ({groups_per_step}), got {dynamic_sampling.groups}")
        self.dynamic_sampling = dynamic_sampling
        self._scenarios = scenarios
        self._policy = 0
        self._start = 0
        self._admitted = 0
        self._changed = asyncio.Condition()
        self._queue: asyncio.Queue[_Finished | Exception | _Done] = asyncio.Queue()
        # admission by staleness: what runs, and the pace it is estimated from
        self._running: Counter[int] = Counter()  # policy version at start -> running groups
        self._pending = 0  # groups admitted and not yet trained or dropped
        self._training = False
        self._held = 0  # groups held back since the last step
        self._durations: deque[float] = deque(maxlen=DURATION_WINDOW)
        self._intervals: deque[float] = deque(maxlen=PACE_WINDOW)
        self._train_s: deque[float] = deque(maxlen=PACE_WINDOW)
        self._changed_at = 0.0
        self.stopped = asyncio.Event()  # set once steps() has ended and its rollouts stopped
        self.cancelled_groups = 0  # groups in flight that steps() cancelled as it ended

    @staticmethod
    def _now() -> float:
        return asyncio.get_running_loop().time()

    def _may_start(self) -> bool:
        due = self._start + self._admitted // self.groups_per_step  # the step it will train
        return self._policy >= due - self.max_steps_off_policy

    def _fits(self) -> bool:
        """Whether a group started now would finish before the batch of its last chance closes
        (at the current pace; True while there is no pace to go by yet)."""
        if not self._durations or not self._intervals:
            return True
        deadline = (self._changed_at + (self.max_steps_off_policy + 1) * _mean(self._intervals)
                    - _mean(self._train_s))
        return self._now() + max(self._durations) <= deadline

    def _may_hold(self) -> bool:
        """Holding a group back cannot starve the trainer: it is training (a policy change is
        coming), or enough groups run or wait to fill its batch."""
        return self._training or self._pending >= self.groups_per_step

    def _release(self, held_at: int) -> bool:
        """A held group starts at the next policy change, or once it fits or must run."""
        return self._policy > held_at or self._fits() or not self._may_hold()

    async def _next_scenario(self, scenarios: AsyncIterator[ScenarioT]
                             ) -> tuple[ScenarioT, int] | _Done:
        async with self._changed:
            held_at: int | None = None
            while True:
                await self._changed.wait_for(self._may_start)
                if (self.staleness == "drop" or held_at is not None or self._fits()
                        or not self._may_hold()):
                    break
                held_at = self._policy
                self._held += 1
                await self._changed.wait_for(functools.partial(self._release, held_at))
            try:
                scenario = await anext(scenarios)
            except StopAsyncIteration:
                return _DONE
            self._admitted += 1
            self._pending += 1
            self._running[self._policy] += 1
            return scenario, self._policy

    async def _worker(self, scenarios: AsyncIterator[ScenarioT]) -> None:
        while (admitted := await self._next_scenario(scenarios)) is not _DONE:
            scenario, started = admitted
            began = self._now()
            try:
                # config None (not given): the rollout_fn takes None where it takes a config
                group = await self.rollout_fn(self.model, scenario, cast(ConfigT, self.config))
            except Exception as e:  # the trainer raises it
                await self._queue.put(e)
                return
            finally:
                async with self._changed:
                    self._running[started] -= 1
                    self._changed.notify_all()
            if not isinstance(group, TrajectoryGroup):
                await self._queue.put(ConfigError(
                    f"rollout_fn must return a TrajectoryGroup, got {type(group).__name__}"))
                return
            seconds = self._now() - began
            self._durations.append(seconds)
            await self._queue.put(_Finished(group, group_policy_version(group, started),
                                            seconds))
        await self._queue.put(_DONE)

    def _last_chance_running(self) -> bool:
        """A running group that this batch is the last to train within the bound."""
        oldest = self._policy - self.max_steps_off_policy
        return any(n > 0 and version <= oldest for version, n in self._running.items())

    async def _keep(self, item: _Finished, report: SamplingReport | None) -> bool:
        """Whether a finished group joins the batches: always, but with dynamic sampling one
        without signal is set aside (its slot given back to admission) until the bound."""
        if report is None:
            return True
        report.drawn += 1
        if len(report.discarded) >= report.limit - report.asked:  # replacements drawn
            report.bound = "draws"
        elif report.out_of_time():
            report.bound = "time"
        if report.judge(item.group, set_aside=report.bound is None) or report.bound:
            return True
        async with self._changed:  # another scenario starts in its place
            self._admitted -= 1
            self._pending -= 1
            self._changed.notify_all()
        return False

    async def _collect(self, ready: list[_Finished], workers: int, finished: list[int],
                       report: SamplingReport | None = None
                       ) -> tuple[list[_Finished], list[_Finished]]:
        """The next batch and the groups dropped as stale on the way. ``ready`` holds finished
        groups not trained yet (those left over stay in it for the next batch); ``report``
        judges arriving groups (dynamic sampling)."""
        dropped: list[_Finished] = []
        admit = self.staleness == "admit"

        def fresh() -> list[_Finished]:
            for f in [f for f in ready if self._policy - f.version > self.max_steps_off_policy]:
                log.info("dropped a group %d versions behind (bound %d)",
                         self._policy - f.version, self.max_steps_off_policy)
                ready.remove(f)
                dropped.append(f)
            return ready

        while finished[0] < workers:
            if len(fresh()) >= self.groups_per_step and not (
                    admit and self._last_chance_running()):
                break
            item = await self._queue.get()
            while True:
                if item is _DONE:
                    finished[0] += 1
                elif isinstance(item, BaseException):
                    raise item
                elif await self._keep(item, report):
                    ready.append(item)
                try:
                    item = self._queue.get_nowait()
                except asyncio.QueueEmpty:
                    break
        fresh()
        if admit:  # oldest first, and every group at its last chance
            ready.sort(key=lambda f: f.version)
            last = self._policy - self.max_steps_off_policy
            size = max(self.groups_per_step, sum(f.version <= last for f in ready))
        else:
            size = self.groups_per_step
        batch = ready[:size]
        del ready[:size]
        if dropped:
            async with self._changed:
                self._pending -= len(dropped)
                self._changed.notify_all()
        return batch, dropped

    def _step_metrics(self, batch: list[_Finished], dropped: list[_Finished], lags: list[int],
                     wait_s: float) -> dict[str, float]:
        """The ``pipeline`` split's metrics of a step: kept and dropped groups with their mean
        rollout length (completion tokens per rollout; seconds per group, its rollouts running
        together), groups held back by admission, the trainer's wait for its batch, and how far
        off-policy the kept groups were."""
        out = {"kept_groups": float(len(batch)), "dropped_groups": float(len(dropped)),
               "held_groups": float(self._held), "wait_s": wait_s,
               "kept_rollout_tokens": _mean(_tokens_per_rollout(f.group) for f in batch),
               "kept_rollout_s": _mean(f.seconds for f in batch),
               "steps_off_policy_max": float(max(lags)),
               "steps_off_policy_mean": _mean(map(float, lags))}
        if dropped:  # (no mean of nothing: a curve of dropped lengths has points only here)
            out["dropped_rollout_tokens"] = _mean(_tokens_per_rollout(f.group) for f in dropped)
            out["dropped_rollout_s"] = _mean(f.seconds for f in dropped)
        return out

    async def steps(self, max_steps: int | None = None) -> AsyncIterator[TrainedStep]:
        """Train until the scenarios run out (or ``max_steps``), yielding each trained step.

        However it ends (``max_steps``, the scenarios run out, an error, the consumer's
        ``break`` or ``aclose()``), the rollouts still in flight are cancelled, their engine
        calls with them, and :attr:`stopped` is set once they have unwound (see the module's
        doc)."""
        self.stopped.clear()
        self._start = self._policy = await self.model.get_step()
        self._changed_at = self._now()
        scenarios = _aiter(self._scenarios)
        workers = [asyncio.create_task(self._worker(scenarios))
                   for _ in range(self.num_rollout_workers)]
        finished = [0]
        trained = 0
        ready: list[_Finished] = []
        try:
            while max_steps is None or trained < max_steps:
                waiting = self._now()
                report = (SamplingReport(self.groups_per_step, self.dynamic_sampling)
                          if self.dynamic_sampling is not None else None)
                batch, dropped = await self._collect(ready, len(workers), finished, report)
                wait_s = self._now() - waiting
                if dropped:
                    await attach_scoped_calls([f.group for f in dropped])
                if report is not None:
                    _close(report, batch, exhausted=finished[0] >= len(workers))
                if not batch:
                    if report is not None and report.discarded:  # their calls are claimed
                        await self.model.log(report.discarded, split=DISCARDED_SPLIT,
                                             step=self._policy)
                    return
                lags = [self._policy - f.version for f in batch]
                groups = [f.group for f in batch]
                for f in batch:
                    f.group.metadata["policy_version"] = f.version
                async with self._changed:
                    self._training = True
                    self._changed.notify_all()
                began = self._now()
                try:
                    metrics = await self.model.train(groups, self.train_config)
                finally:
                    async with self._changed:
                        self._training = False
                        self._pending -= len(batch)
                        self._changed.notify_all()
                step = await self.model.get_step()
                now = self._now()
                pipeline = self._step_metrics(batch, dropped, lags, wait_s)
                async with self._changed:
                    self._train_s.append(now - began)
                    self._intervals.append(now - self._changed_at)
                    self._changed_at, self._policy, self._held = now, step, 0
                    self._changed.notify_all()
                if dropped:
                    await self.model.log([f.group for f in dropped], split="dropped", step=step)
                await self.model.log(split="pipeline", metrics=pipeline, step=step)
                sampling = await log_sampling(self.model, report, step) if report else {}
                trained += 1
                yield TrainedStep(step, groups, {
                    **metrics, **{f"pipeline/{k}": v for k, v in pipeline.items()},
                    "dropped_stale": float(len(dropped)),
                    "steps_off_policy_max": float(max(lags)), **sampling}, len(dropped), lags,
                    len(report.discarded) if report else 0)
        finally:
            await self._stop(workers, ready, scenarios)

    async def _stop(self, workers: list[asyncio.Task[None]], ready: list[_Finished],
                    scenarios: AsyncIterator[ScenarioT]) -> None:
        """:meth:`steps` ended: cancel the rollouts in flight and wait (up to
        :data:`STOP_TIMEOUT_S`) until they have unwound, close the scenario iterator made here,
        log what was left, and set :attr:`stopped`."""
        self.cancelled_groups = running = sum(self._running.values())
        for w in workers:
            w.cancel()
        if workers:
            _, stuck = await asyncio.wait(workers, timeout=STOP_TIMEOUT_S)
            if stuck:
                log.warning("%d rollout worker(s) ignored their cancellation for %g s and are "
                            "left running", len(stuck), STOP_TIMEOUT_S)
        finished = len(ready)
        while not self._queue.empty():
            finished += isinstance(self._queue.get_nowait(), _Finished)
        if scenarios is not self._scenarios:  # the generator over an iterable, made here
            await cast(AsyncGenerator[ScenarioT, None], scenarios).aclose()
        if running or finished:
            log.info("%s: the pipeline stopped; cancelled %d rollout group(s) in flight, "
                     "%d finished group(s) left untrained", self.model.name, running, finished)
        self.stopped.set()


def _art_pipeline(pipeline: PipelineRuntimeConfig | None, autotune: PipelineAutotuneConfig | None,
                  groups_per_step: int, num_rollout_workers: int | None) -> tuple[int, int | None]:
    """``groups_per_step`` and ``num_rollout_workers`` from ART's settings; given both ways
    (other than tracerl's defaults), they must agree."""
    options = pipeline_options_from_art(pipeline, autotune)
    given = {"groups_per_step": (groups_per_step, 4),
             "num_rollout_workers": (num_rollout_workers, None)}
    for name, (value, default) in given.items():
        if name in options and value != default and value != options[name]:
            raise ConfigError(f"{name}={value} disagrees with pipeline=PipelineRuntimeConfig(...) "
                              f"({options[name]}); pass one of them")
    return (options.get("groups_per_step", groups_per_step),
            options.get("num_rollout_workers", num_rollout_workers))


def _close(report: SamplingReport, batch: list[_Finished], exhausted: bool) -> None:
    """A batch's draws are done: its groups with signal count as kept; short of
    ``groups_per_step`` without a bound hit, the scenarios ran out."""
    report.kept = sum(verdict(f.group, report.cfg.tolerance) == "kept" for f in batch)
    report.finish(report.bound or ("exhausted" if exhausted else None))


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
    ``eval_every_n_steps`` steps (and before the first if ``eval_at_start``). ART 0.5.23's
    ``pipeline=PipelineRuntimeConfig(...)`` and ``autotune=`` map onto ``groups_per_step`` and
    ``num_rollout_workers`` (:mod:`tracerl.core.art_pipeline`)."""

    def __init__(self, model: TrainableModel, backend: Backend,
                 rollout_fn: RolloutFn[ScenarioT, ConfigT],
                 scenarios: Iterable[ScenarioT] | AsyncIterator[ScenarioT], config: ConfigT,
                 eval_fn: EvalFn[ConfigT] | None = None, *, groups_per_step: int = 4,
                 num_rollout_workers: int | None = None,
                 learning_rate: float | Literal["auto"] = "auto",
                 train_config: TrainConfig | None = None, max_steps: int | None = None,
                 max_steps_off_policy: int = 4, eval_every_n_steps: int = 20,
                 eval_at_start: bool = True, staleness: Staleness = "admit",
                 dynamic_sampling: DynamicSampling | None = None,
                 pipeline: PipelineRuntimeConfig | None = None,
                 autotune: PipelineAutotuneConfig | None = None) -> None:
        if pipeline is not None or autotune is not None:  # ART 0.5.23's settings
            groups_per_step, num_rollout_workers = _art_pipeline(
                pipeline, autotune, groups_per_step, num_rollout_workers)
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
            train_config=train_config or TrainConfig(learning_rate=learning_rate),
            staleness=staleness, dynamic_sampling=dynamic_sampling)
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
