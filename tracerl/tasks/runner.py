"""Train and evaluate a catalog task: the loop ``tracerl eval``, ``tracerl demo --task`` and
the learning benchmark share. Held-out results are logged as ``val`` through ``model.log``."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

from ..core.config import DynamicSampling, TrainConfig
from ..core.trajectory import RolloutException, Trajectory, TrajectoryGroup
from ..rollout.gather import gather_trajectory_groups
from ..rollout.sampling import SampledGroups, groups_wanted
from .base import Task

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
    """A training run's held-out results: ``evals[step]`` is the ``val`` summary at ``step``."""

    evals: dict[int, dict[str, float]] = field(default_factory=dict)
    train_success: list[float] = field(default_factory=list)
    sampling: list[dict[str, float]] = field(default_factory=list)  # per step (dynamic sampling)
    seconds: float = 0.0

    def success(self, step: int) -> float:
        return self.evals[step].get("metrics/success", 0.0)


async def _step_groups(task: Task, model: Any, step: int, steps: int, *, seed: int,
                       size: int, per_step: int, dynamic: DynamicSampling | None,
                       show_progress: bool) -> list[TrajectoryGroup]:
    """One step's groups: ``per_step`` fresh train items (by ``seed`` and step), ``size``
    rollouts each; with ``dynamic`` sampling, items are drawn until ``per_step`` groups have
    rewards that differ (within its bound)."""
    n = per_step if dynamic is None else math.ceil(per_step * dynamic.max_draw_factor)
    items = task.items("train", n, seed=seed * 100_003 + step)
    return await gather_trajectory_groups(
        (TrajectoryGroup(task.rollout(model, item, temperature=1.0) for _ in range(size))
         for item in items),
        pbar_desc=f"step {step}/{steps}", max_exceptions=math.inf, show_progress=show_progress,
        dynamic_sampling=dynamic)


async def train_task(task: Task, model: Any, *, steps: int, seed: int = 0,
                     eval_every: int = 5, eval_n: int = 24, group_size: int | None = None,
                     items_per_step: int | None = None, config: TrainConfig | None = None,
                     show_progress: bool = False,
                     dynamic_sampling: DynamicSampling | None = None) -> TaskRun:
    """GRPO on ``task``'s train split for ``steps`` steps (continuing from the model's step),
    evaluating greedily on the held-out split before training, every ``eval_every`` steps and
    at the end. Each step draws fresh train items (by ``seed`` and step). With
    ``dynamic_sampling``, groups whose rewards are all equal are set aside and more items are
    drawn until the step has ``items_per_step`` groups with signal (its ``groups``, if set),
    within its bound; train success counts every drawn rollout."""
    run = TaskRun()
    started = time.perf_counter()
    first = await model.get_step()
    config = config or TrainConfig(learning_rate=task.learning_rate, seed=seed)
    size = group_size or task.group_size
    per_step = items_per_step or task.items_per_step
    if dynamic_sampling is not None:
        per_step = groups_wanted(dynamic_sampling, per_step, "train_task")
        dynamic_sampling = dynamic_sampling.model_copy(update={"groups": per_step})
    if first == 0:
        run.evals[0] = await evaluate(task, model, n=eval_n, seed=seed, step=0,
                                      desc="base held-out" if show_progress else None)
    for step in range(first + 1, steps + 1):
        groups = await _step_groups(task, model, step, steps, seed=seed, size=size,
                                    per_step=per_step, dynamic=dynamic_sampling,
                                    show_progress=show_progress)
        drawn = [*groups, *(groups.sampling.discarded if isinstance(groups, SampledGroups)
                            else [])]
        _with_usage(drawn)
        played = [t for g in drawn for t in g.trajectories]
        success = sum(t.metrics.get("success", 0.0) for t in played) / max(len(played), 1)
        run.train_success.append(success)
        trained = await model.train(groups, config=config)
        if isinstance(groups, SampledGroups):
            run.sampling.append({k: v for k, v in trained.items() if k.startswith("sampling/")})
        log.info("%s step %d: train success %.3f", task.name, step, success)
        if step % eval_every == 0 or step == steps:
            run.evals[step] = await evaluate(
                task, model, n=eval_n, seed=seed,
                desc=f"held-out after {step}" if show_progress else None)
    run.seconds = time.perf_counter() - started
    return run
