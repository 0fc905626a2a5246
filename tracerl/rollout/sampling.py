"""Dynamic sampling (DAPO): a step's groups with equal rewards are set aside and more are drawn.

GRPO's advantage is a rollout's reward against its group's: a group whose rewards are all equal
(within :attr:`~tracerl.DynamicSampling.tolerance`), or that has fewer than two rollouts, gives
every token an advantage of 0, so it costs a step's time and teaches nothing. DAPO (Yu et al.,
2025) draws more prompts until the batch has enough groups with a spread of rewards; verl's
recipe (``algorithm.filter_groups``) bounds the draws by ``max_num_gen_batches``. Here:

- :func:`draw_groups` keeps ``asked - kept`` groups running and starts one more from the source
  each time a finished group is set aside (no round barrier: a replacement starts as soon as a
  group is judged), until ``asked`` groups have signal or the bound is hit: at most
  ``max_draw_factor * asked`` groups drawn, no replacement started after ``max_seconds``, or
  the source ran out. Then the step trains on the groups with signal it has (on the set-aside
  ones when it has none: the step trains nothing, but happens and is counted, as without
  dynamic sampling);
- :class:`SamplingReport` counts a step's draws: ``groups_drawn``; ``groups_kept`` (with
  signal, trained); ``groups_discarded`` (set aside, not trained); of all groups without signal,
  ``groups_equal_rewards`` and ``groups_too_few_rollouts``; ``rollouts_drawn``,
  ``draw_seconds``, ``bound_hit``. When the bound is hit it logs a warning saying what was seen
  and what to change (:meth:`SamplingReport.warning`);
- :func:`log_sampling` logs them with the trained step: the counts under the ``sampling`` split
  (``history.jsonl`` and the loggers), the set-aside groups under ``discarded`` (so their calls
  are no orphan calls), and returns the counts as ``sampling/...`` metrics.

``gather_trajectory_groups(..., dynamic_sampling=...)`` returns :class:`SampledGroups`, a list
that carries its report, so that ``model.train(groups)`` logs it with the step.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, TypeVar

from ..core.config import DynamicSampling
from ..core.errors import ConfigError
from ..core.trajectory import TrajectoryGroup, attach_scoped_calls, rewards_spread

if TYPE_CHECKING:
    from .model import Model

log = logging.getLogger(__name__)

T = TypeVar("T")
Verdict = Literal["kept", "equal_rewards", "too_few_rollouts"]
Bound = Literal["draws", "time", "exhausted"]
SAMPLING_SPLIT, DISCARDED_SPLIT = "sampling", "discarded"


def verdict(group: TrajectoryGroup, tolerance: float) -> Verdict:
    """Whether ``group`` carries a GRPO signal: two rollouts or more whose rewards spread by more
    than ``tolerance``."""
    rewards = [t.reward for t in group.trajectories]
    if len(rewards) < 2:
        return "too_few_rollouts"
    return "kept" if rewards_spread(rewards, tolerance) else "equal_rewards"


def groups_wanted(cfg: DynamicSampling, default: int | None, where: str) -> int:
    """The groups with signal a step asks for: ``cfg.groups``, else the loop's ``default``."""
    asked = cfg.groups if cfg.groups is not None else default
    if asked is None:
        raise ConfigError(f"dynamic_sampling.groups: {where} needs the number of groups with "
                          "signal a step asks for (DynamicSampling(groups=4))")
    return asked


@dataclass
class SamplingReport:
    """One step's draws: what was drawn, kept and set aside, and whether the bound was hit."""

    asked: int
    cfg: DynamicSampling
    drawn: int = 0
    kept: int = 0
    verdicts: Counter[str] = field(default_factory=Counter)
    equal_at: Counter[float] = field(default_factory=Counter)  # reward of equal groups
    rollouts: int = 0
    lowest: float = math.inf
    highest: float = -math.inf
    bound: Bound | None = None
    started: float = field(default_factory=time.monotonic)
    seconds: float = 0.0
    discarded: list[TrajectoryGroup] = field(default_factory=list)  # logged apart

    @property
    def limit(self) -> int:
        """The most groups a step draws."""
        return math.ceil(self.cfg.max_draw_factor * self.asked)

    def out_of_time(self) -> bool:
        """``max_seconds`` have passed since the step began drawing."""
        return (self.cfg.max_seconds is not None
                and time.monotonic() - self.started >= self.cfg.max_seconds)

    def judge(self, group: TrajectoryGroup, set_aside: bool = True) -> bool:
        """Count a finished group; True when it carries signal (else it is set aside, unless
        not ``set_aside``: the pipeline trains it once the bound is hit)."""
        v = verdict(group, self.cfg.tolerance)
        self.verdicts[v] += 1
        self.rollouts += len(group.trajectories) + len(group.exceptions)
        for t in group.trajectories:
            self.lowest, self.highest = min(self.lowest, t.reward), max(self.highest, t.reward)
        if v == "equal_rewards":
            self.equal_at[group.trajectories[0].reward] += 1
        if v == "kept":
            self.kept += 1
            return True
        if set_aside:
            self.discarded.append(group)
        return False

    def finish(self, bound: Bound | None) -> None:
        self.seconds = time.monotonic() - self.started
        self.bound = bound if self.kept < self.asked else None
        if (warning := self.warning()) is not None:
            log.warning("dynamic sampling: %s", warning)

    def metrics(self) -> dict[str, float]:
        """The ``sampling`` split's metrics of a step."""
        return {"groups_asked": float(self.asked), "groups_drawn": float(self.drawn),
                "groups_kept": float(self.kept),
                "groups_discarded": float(len(self.discarded)),
                "groups_equal_rewards": float(self.verdicts["equal_rewards"]),
                "groups_too_few_rollouts": float(self.verdicts["too_few_rollouts"]),
                "rollouts_drawn": float(self.rollouts), "draw_seconds": self.seconds,
                "bound_hit": float(self.bound is not None)}

    def warning(self) -> str | None:
        """The step-health line when the bound was hit: what was seen and what to change."""
        if self.bound is None:
            return None
        limit = self.cfg.max_seconds
        why = {"draws": f"the draw bound was reached ({self.drawn} groups: max_draw_factor="
                        f"{self.cfg.max_draw_factor:g} x {self.asked})",
               "time": (f"max_seconds={limit:g} passed" if limit is not None
                        else "no replacement came within timeout_s"),
               "exhausted": "the groups to draw from ran out"}[self.bound]
        equal = ", ".join(f"{n} at {r:g}" for r, n in self.equal_at.most_common(3))
        seen = (f"{self.verdicts['equal_rewards']} groups had equal rewards ({equal}), "
                f"{self.verdicts['too_few_rollouts']} fewer than 2 rollouts")
        at_high = sum(n for r, n in self.equal_at.items() if r >= self.highest)
        at_low = sum(n for r, n in self.equal_at.items() if r <= self.lowest)
        mix = ("harder items (most set-aside groups were all at the highest reward seen)"
               if at_high > at_low else
               "easier items (most set-aside groups were all at the lowest reward seen)"
               if at_low > at_high else "items the model solves only sometimes")
        return (f"{self.kept} of {self.asked} groups with signal after {self.drawn} drawn "
                f"({self.rollouts} rollouts, {self.seconds:.1f} s): {why}; {seen}. Fix: larger "
                f"groups (more rollouts per item), a higher temperature, or a task mix of {mix}; "
                "or raise max_draw_factor / max_seconds")


class SampledGroups(list[TrajectoryGroup]):
    """A step's groups with the :class:`SamplingReport` of how they were drawn
    (``model.train(groups)`` logs it with the step)."""

    def __init__(self, groups: list[TrajectoryGroup], sampling: SamplingReport) -> None:
        super().__init__(groups)
        self.sampling = sampling


def step_groups(kept: list[TrajectoryGroup], report: SamplingReport) -> SampledGroups:
    """The step's groups: those with signal, or the set-aside ones when none has any (then
    trained, nothing learnt, rather than logged apart)."""
    if not kept:
        kept, report.discarded = report.discarded, []
    return SampledGroups(kept, report)


async def draw_groups(source: Iterator[T], report: SamplingReport,
                      run: Callable[[T, int], Coroutine[None, None, list[TrajectoryGroup]]]
                      ) -> SampledGroups:
    """Run groups from ``source`` (``run(item, index)`` gives the item's finished groups) until
    ``report.asked`` of them carry signal or the bound is hit; those with signal come back in
    draw order."""
    running: dict[asyncio.Task[list[TrajectoryGroup]], int] = {}
    drawn: dict[int, list[TrajectoryGroup]] = {}
    kept: dict[int, list[TrajectoryGroup]] = {}
    bound: Bound | None = None
    try:
        while True:
            while report.kept + len(running) < report.asked and bound is None:
                if report.drawn >= report.limit:
                    bound = "draws"
                elif report.drawn >= report.asked and report.out_of_time():  # a replacement
                    bound = "time"
                elif (item := next(source, None)) is None:
                    bound = "exhausted"
                else:
                    running[asyncio.create_task(run(item, report.drawn))] = report.drawn
                    report.drawn += 1
            if not running:
                break
            done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                index = running.pop(task)
                drawn[index] = task.result()
                kept[index] = [g for g in drawn[index] if report.judge(g)]
            if report.kept >= report.asked:
                break
    finally:
        for task in running:
            task.cancel()
    order = {id(g): i for i, groups in drawn.items() for g in groups}
    report.discarded.sort(key=lambda g: order[id(g)])  # in draw order, as the kept ones
    report.finish(bound)
    return step_groups([g for i in sorted(kept) for g in kept[i]], report)


async def log_sampling(model: Model, report: SamplingReport, step: int) -> dict[str, float]:
    """Log a step's draws at ``step``: the set-aside groups under ``discarded``, the counts
    under ``sampling``; returns the counts as ``sampling/...`` metrics."""
    if report.discarded:
        await attach_scoped_calls(report.discarded)
        await model.log(report.discarded, split=DISCARDED_SPLIT, step=step)
    metrics = report.metrics()
    await model.log(split=SAMPLING_SPLIT, metrics=metrics, step=step)
    return {f"{SAMPLING_SPLIT}/{k}": v for k, v in metrics.items()}
