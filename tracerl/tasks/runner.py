"""Train and evaluate a catalog task: the loop ``tracerl eval``, ``tracerl demo --task`` and
the learning benchmark share, synchronous or (``off_policy``) through the async
:class:`~tracerl.rollout.pipeline.RolloutPipeline`. Held-out results are logged as ``val``
through ``model.log``."""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import time
from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

from ..core.config import DynamicSampling, TrainConfig
from ..core.errors import ConfigError, TooManyExceptionsError
from ..core.trajectory import RolloutException, Trajectory, TrajectoryGroup
from ..rollout.gather import gather_trajectory_groups
from ..rollout.pipeline import STALENESS, RolloutPipeline, Staleness, TrainedStep
from ..rollout.sampling import SampledGroups, groups_wanted
from .base import Item, Task

log = logging.getLogger(__name__)


def usage_metrics(trajectory: Trajectory) -> dict[str, float]:
    """LLM calls, sampled tokens and seconds of one rollout, from its recorded calls."""
    tokens = sum(len(c.token_ids) for call in trajectory.llm_calls for c in call.completions)
    seconds = (trajectory.end_time or trajectory.start_time) - trajectory.start_time
    return {"llm_calls": float(len(trajectory.llm_calls)), "completion_tokens": float(tokens),
            "seconds": max(seconds, 0.0)}


def _with_usage(groups: list[TrajectoryGroup]) -> list[TrajectoryGroup]:
    """Add each rollout's usage to its metrics; say why rollouts failed (the first error of
    each kind), since a task whose rollouts all fail trains nothing."""
    errors: dict[str, RolloutException] = {}
    for group in groups:
        for t in group.trajectories:
            t.metrics.update(usage_metrics(t))
        for e in group.exceptions:
            errors.setdefault(e.type, e)
    failed = sum(len(g.exceptions) for g in groups)
    for e in errors.values():
        log.warning("%d rollouts failed; the first %s: %s\n%s", failed, e.type, e.message,
                    e.traceback)
    return groups


def _stop_if_every_rollout_failed(exceptions: list[RolloutException], played: int,
                                 what: str) -> None:
    """Raise when rollouts ran and every one of them raised: nothing can be trained or scored
    (a missing tool such as Node.js, a broken agent), so the run stops with the first error
    rather than going on through steps of nothing."""
    if played or not exceptions:
        return
    first = exceptions[0]
    raise TooManyExceptionsError(
        f"{what}: all {len(exceptions)} rollouts raised, so there is nothing to train or score; "
        f"the first {first.type}: {first.message}\n{first.traceback}")


async def evaluate(task: Task, model: Any, *, n: int = 24, samples: int = 1,
                   temperature: float = 0.0, step: int | None = None, seed: int = 0,
                   log_to_model: bool = True, desc: str | None = None,
                   failures: list[RolloutException] | None = None) -> dict[str, float]:
    """Play ``n`` held-out items ``samples`` times each with the model at ``step`` (``None``:
    the newest; ``0``: the base model) and return the ``val`` summary: reward,
    ``metrics/success``, tool-call validity, turns, tokens and seconds (means over rollouts).
    Logged at that step when ``log_to_model``. The failed rollouts are counted
    (``rollout_errors``) and appended to ``failures`` when it is given."""
    if n < 1 or samples < 1:
        raise ValueError(f"evaluate needs n >= 1 and samples >= 1 (got n={n}, samples={samples})")
    items = task.items("test", n, seed=seed)
    started = time.perf_counter()
    groups = await gather_trajectory_groups(
        (TrajectoryGroup(task.rollout(model, item, temperature=temperature, step=step)
                         for _ in range(samples)) for item in items),
        pbar_desc=desc or f"{task.name} held-out", max_exceptions=math.inf,
        show_progress=desc is not None)
    _with_usage(groups)
    played = [t for g in groups for t in g.trajectories]
    failed = sum(len(g.exceptions) for g in groups)
    if failures is not None:
        failures.extend(e for g in groups for e in g.exceptions)
    extra = {"wall_seconds": time.perf_counter() - started,
             "rollout_errors": float(failed) / max(n * samples, 1)}
    if log_to_model and played:
        logged_step = step if step is not None else await model.get_step()
        summary = await model.log(groups, split="val", metrics=extra, step=logged_step)
        return {k: float(v) for k, v in summary.items() if isinstance(v, int | float)}
    rewards = [t.reward for t in played]
    out = {"reward": sum(rewards) / len(rewards) if rewards else 0.0, **extra}
    for key in sorted({k for t in played for k in t.metrics}):
        values = [t.metrics[key] for t in played if key in t.metrics]
        out[f"metrics/{key}"] = sum(values) / len(values)
    return out


@dataclass
class TaskRun:
    """A training run's held-out results: ``evals[step]`` is the ``val`` summary at ``step``.

    ``seconds`` is the run's wall time; ``eval_seconds`` the part spent in held-out
    evaluations (the base one included) and ``train_seconds`` the rest (rollouts and training).
    With ``off_policy``, rollouts go on during an evaluation: that overlap counts as
    evaluation time, so ``train_seconds`` leaves evaluation out and ``seconds`` includes it.
    ``pipeline`` holds each step's staleness metrics with ``off_policy`` (the pipeline's
    ``pipeline/...`` metrics: kept, dropped and held groups, the trainer's wait,
    ``steps_off_policy_max`` and ``_mean``), else nothing."""

    evals: dict[int, dict[str, float]] = field(default_factory=dict)
    train_success: list[float] = field(default_factory=list)
    sampling: list[dict[str, float]] = field(default_factory=list)  # per step (dynamic sampling)
    pipeline: list[dict[str, float]] = field(default_factory=list)  # per step (off_policy)
    seconds: float = 0.0
    eval_seconds: float = 0.0

    @property
    def train_seconds(self) -> float:
        return self.seconds - self.eval_seconds

    def success(self, step: int) -> float:
        return self.evals[step].get("metrics/success", 0.0)


@dataclass(frozen=True)
class _Plan:
    """What both loops of :func:`train_task` share: the task, the model, the draws per step."""

    task: Task
    model: Any
    first: int  # the model's step before training
    steps: int
    seed: int
    size: int  # rollouts per item
    per_step: int  # items (groups) per step
    dynamic: DynamicSampling | None
    config: TrainConfig
    show_progress: bool

    def draw(self, step: int) -> list[Item]:
        """Step ``step``'s train items (by seed and step); with dynamic sampling, up to
        ``max_draw_factor`` times ``per_step`` of them, to draw from."""
        n = (self.per_step if self.dynamic is None
             else math.ceil(self.per_step * self.dynamic.max_draw_factor))
        return self.task.items("train", n, seed=self.seed * 100_003 + step)


def _success(groups: list[TrajectoryGroup]) -> float:
    played = [t for g in groups for t in g.trajectories]
    return sum(t.metrics.get("success", 0.0) for t in played) / max(len(played), 1)


async def _step_groups(plan: _Plan, step: int) -> list[TrajectoryGroup]:
    """One step's groups: ``per_step`` fresh train items (by seed and step), ``size``
    rollouts each; with dynamic sampling, items are drawn until ``per_step`` groups have
    rewards that differ (within its bound)."""
    return await gather_trajectory_groups(
        (TrajectoryGroup(plan.task.rollout(plan.model, item, temperature=1.0)
                         for _ in range(plan.size)) for item in plan.draw(step)),
        pbar_desc=f"step {step}/{plan.steps}", max_exceptions=math.inf,
        show_progress=plan.show_progress, dynamic_sampling=plan.dynamic)


async def _sync_steps(plan: _Plan, run: TaskRun) -> AsyncGenerator[int, None]:
    """The synchronous loop: draw a step's groups, train on them, yield the step, repeat."""
    for step in range(plan.first + 1, plan.steps + 1):
        groups = await _step_groups(plan, step)
        drawn = [*groups, *(groups.sampling.discarded if isinstance(groups, SampledGroups)
                            else [])]
        run.train_success.append(_success(_with_usage(drawn)))
        _stop_if_every_rollout_failed([e for g in drawn for e in g.exceptions],
                                     sum(len(g.trajectories) for g in drawn),
                                     f"{plan.task.name} step {step}")
        trained = await plan.model.train(groups, config=plan.config)
        if isinstance(groups, SampledGroups):
            run.sampling.append({k: v for k, v in trained.items() if k.startswith("sampling/")})
        log.info("%s step %d: train success %.3f", plan.task.name, step, run.train_success[-1])
        yield step


def _pipeline(plan: _Plan, off_policy: int, staleness: Staleness,
              finished: list[TrajectoryGroup]) -> RolloutPipeline[Item, None]:
    """A pipeline over the train items in the order the synchronous loop draws them (step
    after step, on past ``steps`` for the rollouts running ahead); each finished group is
    appended to ``finished``."""
    def items() -> Iterator[Item]:
        for step in itertools.count(plan.first + 1):
            yield from plan.draw(step)

    async def play(model: Any, item: Item, _config: None) -> TrajectoryGroup:
        (group,) = await gather_trajectory_groups(
            [TrajectoryGroup(plan.task.rollout(model, item, temperature=1.0)
                             for _ in range(plan.size))],
            pbar_desc=None, max_exceptions=math.inf, show_progress=False)
        finished.extend(_with_usage([group]))
        return group

    return RolloutPipeline(plan.model, play, items(), groups_per_step=plan.per_step,
                           max_steps_off_policy=off_policy, train_config=plan.config,
                           staleness=staleness, dynamic_sampling=plan.dynamic)


async def _pipeline_steps(plan: _Plan, run: TaskRun, pipeline: RolloutPipeline[Item, None],
                          finished: list[TrajectoryGroup]) -> AsyncGenerator[int, None]:
    """The pipeline's trained steps; a step's train success counts the rollouts that
    finished since the step before (trained, set aside or dropped as stale)."""
    if plan.steps <= plan.first:
        return
    ahead = cast(AsyncGenerator[TrainedStep, None], pipeline.steps(plan.steps - plan.first))
    async with contextlib.aclosing(ahead) as trained:
        async for t in trained:
            _stop_if_every_rollout_failed([e for g in finished for e in g.exceptions],
                                         sum(len(g.trajectories) for g in finished),
                                         f"{plan.task.name} step {t.step}")
            run.train_success.append(_success(finished))
            finished.clear()
            run.pipeline.append({k: v for k, v in t.metrics.items()
                                 if k.startswith("pipeline/")})
            if plan.dynamic is not None:
                run.sampling.append({k: v for k, v in t.metrics.items()
                                     if k.startswith("sampling/")})
            log.info("%s step %d: train success %.3f, %d step(s) off-policy at most",
                     plan.task.name, t.step, run.train_success[-1], max(t.steps_off_policy))
            yield t.step


def _check(off_policy: int | None, staleness: str) -> None:
    if off_policy is not None and (isinstance(off_policy, bool) or not isinstance(
            off_policy, int) or off_policy < 0):
        raise ConfigError(f"off_policy must be None or an int >= 0, got {off_policy!r}")
    if staleness not in STALENESS:
        raise ConfigError(f"staleness must be one of {', '.join(STALENESS)}, got {staleness!r}")


async def train_task(task: Task, model: Any, *, steps: int, seed: int = 0,
                     eval_every: int = 5, eval_n: int = 24, group_size: int | None = None,
                     items_per_step: int | None = None, config: TrainConfig | None = None,
                     show_progress: bool = False,
                     dynamic_sampling: DynamicSampling | None = None,
                     off_policy: int | None = None, staleness: str = "admit") -> TaskRun:
    """GRPO on ``task``'s train split for ``steps`` steps (continuing from the model's step),
    evaluating greedily on the held-out split before training, every ``eval_every`` steps and
    at the end. Each step draws fresh train items (by ``seed`` and step). With
    ``dynamic_sampling``, groups whose rewards are all equal are set aside and more items are
    drawn until the step has ``items_per_step`` groups with signal (its ``groups``, if set),
    within its bound; train success counts every drawn rollout.

    ``off_policy=None`` runs the synchronous loop (a step's rollouts, then its training).
    ``off_policy=b`` runs the steps through a :class:`~tracerl.rollout.pipeline.RolloutPipeline`
    instead (``max_steps_off_policy=b``, ``staleness`` ``"admit"`` or ``"drop"``): the same
    train items in the same order, ``items_per_step`` groups a step, rollouts running up to
    ``b`` steps ahead of the trainer (and on during evaluations). The model's engine must stay
    awake while training (``sleep_during_training`` not True); ``resident_adapters=b + 1``
    lets a multi-turn rollout finish on the version it started with."""
    _check(off_policy, staleness)
    run = TaskRun()
    started = time.perf_counter()
    first = await model.get_step()
    size = group_size or task.group_size
    per_step = items_per_step or task.items_per_step
    if dynamic_sampling is not None:
        per_step = groups_wanted(dynamic_sampling, per_step, "train_task")
        dynamic_sampling = dynamic_sampling.model_copy(update={"groups": per_step})
    plan = _Plan(task, model, first, steps, seed, size, per_step, dynamic_sampling,
                 config or TrainConfig(learning_rate=task.learning_rate, seed=seed),
                 show_progress)
    if off_policy is None:
        trained = _sync_steps(plan, run)
    else:  # the pipeline is made (and checks its settings) before anything runs
        finished: list[TrajectoryGroup] = []
        pipeline = _pipeline(plan, off_policy, cast(Staleness, staleness), finished)
        trained = _pipeline_steps(plan, run, pipeline, finished)

    async def held_out(step: int | None, desc: str) -> dict[str, float]:
        began = time.perf_counter()
        failures: list[RolloutException] = []
        try:
            result = await evaluate(task, model, n=eval_n, seed=seed, step=step,
                                    desc=desc if show_progress else None, failures=failures)
        finally:
            run.eval_seconds += time.perf_counter() - began
        _stop_if_every_rollout_failed(failures, eval_n - len(failures), f"{task.name} {desc}")
        return result

    if first == 0:
        run.evals[0] = await held_out(0, "base held-out")
    async with contextlib.aclosing(trained) as steps_trained:
        async for step in steps_trained:
            if step % eval_every == 0 or step == steps:
                run.evals[step] = await held_out(None, f"held-out after {step}")
    run.seconds = time.perf_counter() - started
    return run
