"""ART's capture scopes: a rollout's LLM calls captured into a trajectory by scope.

- ``await trajectory(coro)``: runs ``coro`` inside ``with Trajectory():`` and returns that
  trajectory, its recorded calls attached (set the reward through ``current_trajectory()``).
- ``await trajectory_group([...])``: trajectories, exceptions and awaitables (each run as a
  rollout of its own, concurrently) into one group.
- The older names: ``capture_auto_trajectory``/``auto_trajectory`` (the same scope), and
  ``capture_yielded_trajectory``/``yield_trajectory`` (the rollout hands its trajectory over).

The scope itself (``with Trajectory():``, ``current_trajectory``, ``no_capture``) is in
:mod:`tracerl.core.trajectory`: it is a rollout context, so the gateway records every call made
inside under the trajectory's ``rollout_id``.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
from collections.abc import Awaitable, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any

from ..core.context import rollout_scope
from ..core.trajectory import (
    RolloutException,
    Trajectory,
    TrajectoryGroup,
    attach_scoped_calls,
    current_trajectory,
    no_capture,
)
from .gather import DEFAULT_ROLLOUT_TIMEOUT_S, finish_rollout, run_rollout


def _require_coroutine(value: object, where: str) -> None:
    if not inspect.iscoroutine(value):
        raise TypeError(f"{where} takes a coroutine (call the rollout function without "
                        f"awaiting it), got {type(value).__name__}")


async def trajectory(coroutine: Coroutine[Any, Any, object]) -> Trajectory:
    """Run ``coroutine`` as a rollout captured into a new trajectory (ART's ``art.trajectory``);
    messages are filled from its last chat call when the code set none."""
    _require_coroutine(coroutine, "trajectory()")
    with Trajectory() as captured:
        await coroutine
    assert captured.scope is not None  # set by `with Trajectory()`, kept after the block
    return await finish_rollout(captured, captured.scope)


async def trajectory_group(
    trajectories: Iterable[Trajectory | BaseException | Awaitable[Trajectory]], *,
    exceptions: Iterable[BaseException | RolloutException] = (),
    metadata: dict[str, Any] | None = None, metrics: dict[str, float] | None = None,
    logs: list[str] | None = None, return_exceptions: bool = False,
    rollout_timeout: float | None = DEFAULT_ROLLOUT_TIMEOUT_S,
) -> TrajectoryGroup:
    """A group from trajectories, exceptions and awaitables (ART's ``art.trajectory_group``).

    Awaitables run concurrently, each as a rollout of its own and outside any enclosing capture;
    a failing one raises unless ``return_exceptions``, which keeps it as the group's failed
    rollout. Trajectories captured by ``with Trajectory():`` get their recorded calls here."""
    items = list(trajectories)
    results: list[Trajectory | BaseException | None] = [None] * len(items)
    tasks: dict[asyncio.Task[Trajectory], int] = {}
    with no_capture():
        for i, item in enumerate(items):
            if isinstance(item, Trajectory | BaseException):
                results[i] = item
            elif inspect.isawaitable(item):
                tasks[asyncio.create_task(run_rollout(item, rollout_timeout, i, None),
                                          context=contextvars.copy_context())] = i
            else:
                raise TypeError(f"trajectory_group: item {i} is a {type(item).__name__}, not a "
                                "Trajectory, an exception or an awaitable")
    try:
        for task, i in tasks.items():
            try:
                results[i] = await task
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if not return_exceptions:
                    raise
                results[i] = e
    finally:
        for task in tasks:
            task.cancel()
    group = TrajectoryGroup([r for r in results if r is not None], exceptions=exceptions,
                            metadata=metadata, metrics=metrics or {}, logs=logs or [])
    await attach_scoped_calls([group])
    return group


def auto_trajectory(*, required: bool = False) -> Trajectory | None:
    """ART's older name of :func:`current_trajectory` (``required`` instead of ``require``)."""
    return current_trajectory(require=required)


async def capture_auto_trajectory(coroutine: Coroutine[Any, Any, Any]) -> Trajectory:
    """ART's older name of :func:`trajectory`."""
    return await trajectory(coroutine)


@dataclass
class _Yielded:
    trajectory: Trajectory | None = None


_yielded: contextvars.ContextVar[_Yielded | None] = contextvars.ContextVar(
    "tracerl_yielded_trajectory", default=None)


def yield_trajectory(trajectory: Trajectory) -> None:
    """Hand ``trajectory`` to the enclosing :func:`capture_yielded_trajectory` (ART's)."""
    holder = _yielded.get()
    if holder is None:
        raise RuntimeError("yield_trajectory() called outside capture_yielded_trajectory(...)")
    holder.trajectory = trajectory


async def capture_yielded_trajectory(coroutine: Coroutine[Any, Any, Any]) -> Trajectory:
    """Run ``coroutine`` as a rollout and return the trajectory it yielded with
    :func:`yield_trajectory`, its recorded calls attached (ART's)."""
    _require_coroutine(coroutine, "capture_yielded_trajectory()")
    holder = _Yielded()
    token = _yielded.set(holder)
    try:
        with rollout_scope() as rollout:
            await coroutine
    finally:
        _yielded.reset(token)
    if holder.trajectory is None:
        raise RuntimeError("No trajectory yielded: the coroutine never called "
                           "yield_trajectory(trajectory)")
    return await finish_rollout(holder.trajectory, rollout)
