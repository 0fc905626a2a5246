"""Where every hook is fired: the lifecycle of rollouts, LLM calls, training steps and logs.

Stages report what happened (a rollout started, a call was recorded, a backend yielded a
:class:`~tracerl.core.backend.TrainEvent`); this module turns it into hook calls, in one place,
on the thread each hook's documentation promises (:mod:`tracerl.events.hookspecs`).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..core.errors import PluginError
from .plugins import get_plugin_manager

if TYPE_CHECKING:
    from ..core.backend import TrainEvent
    from ..core.config import TrainConfig
    from ..core.context import RolloutContext
    from ..core.model_spec import ModelSpec
    from ..core.trajectory import LLMCall, Trajectory, TrajectoryGroup


def rollout_started(rollout: RolloutContext) -> list[Callable[[], None]]:
    """Fire ``tracerl_rollout_started``; returns the undo functions the plugins gave back."""
    results = get_plugin_manager().hook.tracerl_rollout_started(rollout=rollout)
    return [undo for undo in results if undo is not None]


def llm_call_recorded(call: LLMCall) -> None:
    """Fire ``tracerl_on_llm_call`` (on the gateway's loop)."""
    get_plugin_manager().hook.tracerl_on_llm_call(call=call)


def trajectory_finished(trajectory: Trajectory) -> None:
    """Fire ``tracerl_on_trajectory_end`` (on the rollout's loop)."""
    get_plugin_manager().hook.tracerl_on_trajectory_end(trajectory=trajectory)


async def train_event(model: ModelSpec, event: TrainEvent, groups: list[TrajectoryGroup],
                      config: TrainConfig, *, log_metrics: bool = True) -> None:
    """Fire the hooks of one training event, in a worker thread: ``started`` -> before the
    step; ``done`` -> after the step, then (``log_metrics``) the step's metrics to the loggers
    (ART 0.5's ``backend.train`` leaves that to ``model.log``)."""
    hook = get_plugin_manager().hook
    if event.kind == "started":
        await asyncio.to_thread(hook.tracerl_before_train_step, model=model, step=event.step,
                                groups=groups, config=config)
    elif event.kind == "done":
        await asyncio.to_thread(hook.tracerl_after_train_step, model=model, step=event.step,
                                metrics=event.metrics)
        if log_metrics:
            await asyncio.to_thread(hook.tracerl_log_metrics, model=model, step=event.step,
                                    split="train", metrics=event.metrics)


async def step_logged(model: ModelSpec, step: int, split: str, metrics: dict[str, float],
                      groups: list[TrajectoryGroup]) -> None:
    """Fire the logging hooks of ``model.log``, in a worker thread (the trajectories hook only
    when there are groups: ``model.log(metrics=...)`` logs metrics alone)."""
    hook = get_plugin_manager().hook
    await asyncio.to_thread(hook.tracerl_log_metrics, model=model, step=step, split=split,
                            metrics=metrics)
    if groups:
        await asyncio.to_thread(hook.tracerl_log_trajectories, model=model, step=step,
                                split=split, groups=groups)


async def online_batch(model: ModelSpec, step: int, groups: list[TrajectoryGroup]) -> None:
    """Fire ``tracerl_online_batch`` (in a worker thread), before the batch trains."""
    await asyncio.to_thread(get_plugin_manager().hook.tracerl_online_batch, model=model,
                            step=step, groups=groups)


async def score_group(group: TrajectoryGroup, judge: str | None = None
                      ) -> TrajectoryGroup | None:
    """Score ``group`` with the first judge plugin that accepts it (``judge`` names one)."""
    result = get_plugin_manager().hook.tracerl_score_group(group=group, judge=judge)
    if result is None:
        raise PluginError(f"no judge plugin scores groups (judge={judge!r}); "
                          "see `tracerl plugins`")
    scored: TrajectoryGroup | None = await result if inspect.isawaitable(result) else result
    return scored


async def art_train_event(model: ModelSpec, event: TrainEvent, groups: list[TrajectoryGroup],
                          config: TrainConfig) -> None:
    """The hooks of an event of ART's ``backend.train`` (which logs nothing, as ART's does)."""
    await train_event(model, event, groups, config, log_metrics=False)
