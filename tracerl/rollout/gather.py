"""Running rollouts concurrently: ``gather_trajectory_groups`` and awaitable groups.

Each rollout runs in its own task with its own rollout context, under a timeout, so a stuck
rollout becomes a recorded :class:`RolloutTimeoutError` instead of a silent hang.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import math
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, NoReturn

from tqdm.auto import tqdm

from ..core import settings
from ..core.config import DynamicSampling
from ..core.context import (
    RolloutContext,
    current_rollout,
    enter_rollout,
    new_rollout_id,
    rollout_scope,
)
from ..core.errors import RolloutTimeoutError, TooManyExceptionsError
from ..core.spans import awaited_span_ids, link_spans_to_calls
from ..core.trajectory import (
    PendingTrajectoryGroup,
    RolloutException,
    Trajectory,
    TrajectoryGroup,
    calls_of,
    fill_messages_from_calls,
    spans_of,
)
from ..core.watchdog import watch
from ..events.lifecycle import trajectory_finished
from .client import CLOSED_KEY
from .sampling import SampledGroups, SamplingReport, draw_groups, groups_wanted

DEFAULT_ROLLOUT_TIMEOUT_S = 600.0
CANCEL_WAIT_S = 10.0  # a cancelled group waits this long for its rollouts to unwind
SPAN_POLL_FIRST_S, SPAN_POLL_MAX_S = 0.01, 0.25  # polls for spans posted after the answer

log = logging.getLogger(__name__)

AfterEach = Callable[[TrajectoryGroup], Awaitable[TrajectoryGroup | list[TrajectoryGroup] | None]]


@dataclass
class GatherContext:
    """Progress and failure accounting shared by the rollouts of one gather call."""

    total: int
    max_exceptions: int | float = 0
    rollout_timeout: float | None = DEFAULT_ROLLOUT_TIMEOUT_S
    desc: str | None = "gather"
    show_progress: bool = True
    max_metrics: int | None = None
    done: int = 0
    exceptions: list[RolloutException] = field(default_factory=list)
    reward_sum: float = 0.0
    rewarded: int = 0
    metric_sums: Counter[str] = field(default_factory=Counter)
    metric_counts: Counter[str] = field(default_factory=Counter)
    completion_tokens: int = 0
    running: dict[str, RolloutContext] = field(default_factory=dict)  # for the watchdog
    _bar: tqdm[NoReturn] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_exceptions, bool) or self.max_exceptions < 0:
            raise ValueError(
                f"max_exceptions must be a count >= 0 or a fraction, got {self.max_exceptions!r}"
            )
        if self.show_progress:
            self._bar = tqdm(total=self.total, desc=self.desc, file=sys.stderr, dynamic_ncols=True)

    def add(self, rollouts: int) -> None:
        """More rollouts to run (a group drawn by dynamic sampling)."""
        self.total += rollouts
        if self._bar is not None:
            self._bar.total = self.total
            self._bar.refresh()

    @property
    def allowed_exceptions(self) -> float:
        m = self.max_exceptions
        if isinstance(m, float) and 0 < m < 1:
            return math.floor(m * self.total)
        return m

    def record(
        self, trajectory: Trajectory | None = None, exc: RolloutException | None = None
    ) -> None:
        self.done += 1
        if trajectory is not None:
            self.reward_sum += trajectory.reward
            self.rewarded += 1
            self.metric_sums.update(trajectory.metrics)
            self.metric_counts.update(trajectory.metrics.keys())
            self.completion_tokens += trajectory.completion_tokens
        if exc is not None:
            self.exceptions.append(exc)
        if self._bar is not None:
            self._bar.set_postfix(self.postfix(), refresh=False)
            self._bar.update(1)

    def postfix(self) -> dict[str, str]:
        """What the progress bar shows: mean reward, mean metrics (the first ``max_metrics``),
        failures, and the completion tokens recorded so far."""
        out = {"reward": f"{self.reward_sum / max(self.rewarded, 1):.3f}"}
        names = (
            list(self.metric_sums)[: self.max_metrics]
            if self.max_metrics is not None
            else self.metric_sums
        )
        out.update(
            {name: f"{self.metric_sums[name] / self.metric_counts[name]:.3g}" for name in names}
        )
        if self.exceptions:
            out["exceptions"] = str(len(self.exceptions))
        if self.completion_tokens:
            out["completion_tokens"] = str(self.completion_tokens)
        return out

    def describe_pending(self, limit: int = 5) -> str:
        """The rollouts still running, oldest first, each with its last call (watchdog)."""
        now = time.time()
        running = sorted(self.running.values(), key=lambda r: r.started_at)
        parts = []
        for r in running[:limit]:
            last = (f"last call {r.last_call} {now - r.last_call_at:.0f} s ago"
                    if r.last_call and r.last_call_at else "no call made yet")
            parts.append(f"rollout {r.index} of group {r.group_index} ({r.rollout_id}, "
                         f"{now - r.started_at:.0f} s): {last}")
        more = f"; {len(running) - limit} more" if len(running) > limit else ""
        return (f"{len(running)} of {self.total} rollouts still running: "
                + "; ".join(parts) + more)

    def check_exceptions(self) -> None:
        if len(self.exceptions) > self.allowed_exceptions:
            first = self.exceptions[0]
            raise TooManyExceptionsError(
                f"{len(self.exceptions)} of {self.total} rollouts failed, more than max_exceptions="
                f"{self.max_exceptions!r} allows; first: {first.type}: {first.message}\n"
                f"{first.traceback}"
            )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


_gather_ctx: contextvars.ContextVar[GatherContext | None] = contextvars.ContextVar(
    "tracerl_gather", default=None
)


async def _attach_calls(trajectory: Trajectory, rollout: RolloutContext) -> None:
    """Attach the gateway's token records of this rollout to its trajectory."""
    if not trajectory.llm_calls:
        trajectory.llm_calls = await calls_of(rollout)


async def _attach_spans(trajectory: Trajectory, rollout: RolloutContext) -> None:
    """Attach adapter spans, and those posted to the gateway (LiteLLM proxy), and link each
    LLM span to its token record. A proxy posts a call's span after the answer, so spans the
    calls announced are waited for, until ``TRACERL_SPAN_WAIT_S``."""
    if rollout.spans and not trajectory.spans:
        trajectory.spans = list(rollout.spans)
    wait_s = settings.TRACERL_SPAN_WAIT_S.get()
    deadline = time.monotonic() + wait_s
    pause = SPAN_POLL_FIRST_S
    while True:
        have = {s.id for s in trajectory.spans}
        trajectory.spans.extend(s for s in await spans_of(rollout) if s.id not in have)
        missing = awaited_span_ids(trajectory.spans, trajectory.llm_calls)
        if not missing:
            break
        left = deadline - time.monotonic()
        if left <= 0:  # the whole wait: a poll never gives up early because its pause is long
            log.warning("rollout %s: %d span(s) its calls announced were not posted within "
                        "%g s (TRACERL_SPAN_WAIT_S), so its trajectory goes without them: %s",
                        rollout.rollout_id, len(missing), wait_s, ", ".join(sorted(missing)))
            break
        await asyncio.sleep(min(pause, left))  # a poll with a deadline: the post lands there
        pause = min(pause * 2, SPAN_POLL_MAX_S)
    link_spans_to_calls(trajectory.spans, trajectory.llm_calls)


async def finish_rollout(trajectory: object, rollout: RolloutContext) -> Trajectory:
    """Validate a rollout's result, stamp it with its rollout id and attach its LLM calls."""
    if not isinstance(trajectory, Trajectory):
        raise TypeError(
            f"a rollout must return a tracerl.Trajectory, got {type(trajectory).__name__}"
        )
    if trajectory.scope is not None:  # captured by its own `with Trajectory():` block
        rollout = trajectory.scope
    if not (trajectory.llm_calls and trajectory.rollout_id):
        trajectory.rollout_id = rollout.rollout_id
    # else it holds its calls already (one taken from the rollout API): it keeps the id they
    # were recorded under, so that training claims them
    if trajectory.end_time is None:
        trajectory.end_time = time.time()
    await _attach_calls(trajectory, rollout)
    rollout.metadata[CLOSED_KEY] = time.time()  # a call sent after this is warned about
    await _attach_spans(trajectory, rollout)
    fill_messages_from_calls(trajectory)
    trajectory_finished(trajectory)
    return trajectory


async def run_rollout(
    awaitable: Awaitable[Trajectory], timeout: float | None, index: int, group_index: int | None
) -> Trajectory:
    rollout = RolloutContext(rollout_id=new_rollout_id(), index=index, group_index=group_index)
    enter_rollout(rollout)  # this coroutine runs in a task of its own, in a copied context
    gather = _gather_ctx.get()

    async def drive() -> object:  # a Trajectory, checked by finish_rollout
        return await awaitable

    if gather is not None:
        gather.running[rollout.rollout_id] = rollout
    try:
        result = await asyncio.wait_for(drive(), timeout)
    except TimeoutError:
        raise RolloutTimeoutError(
            f"rollout {index} of group {group_index} ({rollout.rollout_id}) did not finish "
            f"within {timeout} s (rollout_timeout)"
        ) from None
    finally:
        if gather is not None:
            gather.running.pop(rollout.rollout_id, None)
    return await finish_rollout(result, rollout)


async def run_as_rollout(fn: Callable[[], Awaitable[Trajectory]]) -> Trajectory:
    """Run ``fn()`` as a rollout: in the current one (inside gather), else in a new one that is
    finished here (calls and spans attached), so rollout helpers also work on their own."""
    if current_rollout() is not None:
        return await fn()
    with rollout_scope() as rollout:
        result = await fn()
    return await finish_rollout(result, rollout)


async def run_group(pending: PendingTrajectoryGroup, group_index: int | None = None
                    ) -> TrajectoryGroup:
    """Run the rollouts of a pending group concurrently, each in its own rollout context;
    failed rollouts become the group's exceptions (within the gather's ``max_exceptions``)."""
    gather = _gather_ctx.get()
    own = gather is None
    if gather is None:  # awaited on its own: keep every exception, raise none
        gather = GatherContext(total=len(pending.awaitables), max_exceptions=math.inf,
                               show_progress=False)
    tasks = []
    for i, aw in enumerate(pending.awaitables):
        ctx = contextvars.copy_context()
        tasks.append(asyncio.create_task(
            run_rollout(aw, gather.rollout_timeout, i, group_index), context=ctx))
    trajectories: list[Trajectory] = []
    exceptions = list(pending.exceptions)
    try:
        for task in tasks:
            try:
                traj = await asyncio.shield(task)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                exc = RolloutException.from_exception(e)
                exceptions.append(exc)
                gather.record(exc=exc)
                gather.check_exceptions()
            else:
                trajectories.append(traj)
                gather.record(trajectory=traj)
    finally:
        for task in tasks:
            task.cancel()
        if unwinding := [t for t in tasks if not t.done()]:  # cancelled: requests closed first
            await asyncio.wait(unwinding, timeout=CANCEL_WAIT_S)
        if own:
            gather.close()
    return TrajectoryGroup(trajectories, exceptions=exceptions, metadata=pending.metadata,
                           metrics=pending.metrics, logs=pending.logs)


# ``await TrajectoryGroup(rollouts)`` (ART's awaitable group) runs them here
PendingTrajectoryGroup.run_rollouts = run_group


async def _await_group(
    group: Awaitable[TrajectoryGroup], index: int, after_each: AfterEach | None
) -> list[TrajectoryGroup]:
    if isinstance(group, PendingTrajectoryGroup):
        result = await run_group(group, group_index=index)
    else:
        result = await group
    if after_each is None:
        return [result]
    scored = await after_each(result)
    if scored is None:
        return []
    return scored if isinstance(scored, list) else [scored]


async def gather_trajectory_groups(
    groups: Iterable[Awaitable[TrajectoryGroup]],
    *,
    pbar_desc: str | None = "gather",
    pbar_total_completion_tokens: bool = False,
    max_exceptions: int | float = 0,
    max_metrics: int | None = None,
    after_each: AfterEach | None = None,
    rollout_timeout: float | None = DEFAULT_ROLLOUT_TIMEOUT_S,
    show_progress: bool = True,
    dynamic_sampling: DynamicSampling | None = None,
) -> list[TrajectoryGroup]:
    """Run groups of rollouts concurrently and return their groups in input order.

    ``max_exceptions``: how many rollouts may fail (an int, or a fraction of all rollouts such as
    0.1) before the whole gather fails with :class:`TooManyExceptionsError`; failed rollouts are
    kept in ``group.exceptions``. ``after_each`` gets each finished group (e.g. a RULER judge) and
    returns the group to keep, a list of groups, or None to drop it. ``rollout_timeout`` bounds
    every rollout (None: no bound). The progress bar shows the mean reward, the mean of each
    metric (the first ``max_metrics``) and the completion tokens recorded so far (always, so
    ART's ``pbar_total_completion_tokens`` is accepted and changes nothing).

    ``dynamic_sampling`` (off by default, as in ART): ``groups`` is then read lazily, as a
    source to draw from (a generator over more items than a step needs), until
    ``dynamic_sampling.groups`` groups have rewards that differ; groups with equal rewards are
    set aside (:mod:`.sampling`). The result is then a :class:`~.sampling.SampledGroups` whose
    report ``model.train`` logs with the step.
    """
    del pbar_total_completion_tokens
    if dynamic_sampling is not None:
        asked = groups_wanted(dynamic_sampling, None, "gather_trajectory_groups")
        source: Iterator[Awaitable[TrajectoryGroup]] = iter(groups)
        groups, total = [], 0
    else:
        groups = list(groups)
        total = sum(len(g) if isinstance(g, PendingTrajectoryGroup) else 1 for g in groups)
    gather = GatherContext(
        total=total,
        max_exceptions=max_exceptions,
        rollout_timeout=rollout_timeout,
        desc=pbar_desc,
        show_progress=show_progress,
        max_metrics=max_metrics,
    )
    token = _gather_ctx.set(gather)
    tasks = [asyncio.create_task(_await_group(g, i, after_each)) for i, g in enumerate(groups)]
    try:
        with watch("gather", f"gather {pbar_desc or ''}".strip(), gather.describe_pending):
            if dynamic_sampling is not None:
                return await _draw_with_signal(source, SamplingReport(asked, dynamic_sampling),
                                               gather, after_each)
            if tasks:
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
                for t in done:
                    if (exc := t.exception()) is not None:
                        raise exc
        return [g for t in tasks for g in t.result()]
    finally:
        for t in tasks:
            t.cancel()
        _gather_ctx.reset(token)
        gather.close()


async def _draw_with_signal(source: Iterator[Awaitable[TrajectoryGroup]], report: SamplingReport,
                            gather: GatherContext, after_each: AfterEach | None
                            ) -> SampledGroups:
    """Dynamic sampling's draws from ``source``, each group run as gather runs it."""
    def run(group: Awaitable[TrajectoryGroup], index: int
            ) -> Coroutine[None, None, list[TrajectoryGroup]]:
        gather.add(len(group) if isinstance(group, PendingTrajectoryGroup) else 1)
        return _await_group(group, index, after_each)

    return await draw_groups(source, report, run)


async def gather_trajectories(
    trajectories: Iterable[Awaitable[Trajectory]], **kwargs: Any
) -> list[Trajectory]:
    """Run rollouts that form no groups; failed ones are dropped within ``max_exceptions``."""
    group = TrajectoryGroup(list(trajectories))
    (result,) = await gather_trajectory_groups([group], **kwargs)
    return result.trajectories


async def trajectory_group_batches(
    groups: Iterable[Awaitable[TrajectoryGroup]], *, batch_size: int,
    max_batch_exceptions: int | float = 0, max_concurrent_batches: int = 4,
    skip_batches: int = 0, pbar_desc: str | None = "batches",
    pbar_total_completion_tokens: bool = False,
    rollout_timeout: float | None = DEFAULT_ROLLOUT_TIMEOUT_S, show_progress: bool = True,
) -> AsyncIterator[list[TrajectoryGroup]]:
    """Yield batches of ``batch_size`` finished groups, in completion order, while up to
    ``max_concurrent_batches`` batches' groups run (ART's ``art.trajectory_group_batches``).
    The first ``skip_batches`` batches' groups are not run (resuming); the last batch may be
    smaller. ``max_batch_exceptions`` bounds the failed rollouts (a count, or a fraction of all
    rollouts)."""
    del pbar_total_completion_tokens
    unstarted = list(groups)[batch_size * skip_batches:]
    total = sum(len(g) if isinstance(g, PendingTrajectoryGroup) else 1 for g in unstarted)
    gather = GatherContext(total=total, max_exceptions=max_batch_exceptions,
                           rollout_timeout=rollout_timeout, desc=pbar_desc,
                           show_progress=show_progress)
    context = contextvars.copy_context()  # the rollouts' context: this gather's accounting
    context.run(_gather_ctx.set, gather)
    running: set[asyncio.Task[list[TrajectoryGroup]]] = set()
    batch: list[TrajectoryGroup] = []
    started = 0
    try:
        while unstarted or running:
            while unstarted and len(running) < batch_size * max_concurrent_batches:
                running.add(asyncio.create_task(_await_group(unstarted.pop(0), started, None),
                                                context=context.copy()))
                started += 1
            done, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                batch.extend(task.result())
            while len(batch) >= batch_size:
                yield batch[:batch_size]
                batch = batch[batch_size:]
        if batch:
            yield batch
    finally:
        for task in running:
            task.cancel()
        gather.close()


def why_no_training_data(groups: Iterable[TrajectoryGroup]) -> str | None:
    """Why these groups give GRPO nothing to learn from, with what to change; None when some
    group has recorded calls and rewards that differ."""
    groups = list(groups)
    trajectories = [t for g in groups for t in g.trajectories]
    if not trajectories:
        failed = sum(len(g.exceptions) for g in groups)
        return (f"all groups failed ({failed} rollout exceptions, no trajectories): see "
                "group.exceptions for the errors; fix the rollout code or raise max_exceptions")
    if not any(t.llm_calls for t in trajectories):
        return ("no calls were attributed to any rollout: the agent's LLM calls did not reach "
                "the model's gateway from inside its rollout; use the model's clients "
                "(model.openai_client(), init_chat_model(model), TracerlModelProvider(model), "
                "completion_kwargs(model)) inside the rollout function, and await them before "
                "it returns")
    if not any(len({t.reward for t in g.trajectories if t.llm_calls}) > 1 for g in groups):
        return ("all rewards are equal within every group, so every GRPO advantage is 0: make "
                "the reward separate better from worse answers (graded, not pass/fail), "
                "use larger groups or harder/easier tasks")
    return None
