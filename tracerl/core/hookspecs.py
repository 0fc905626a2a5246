"""Every hook tracerl calls, in one place; the docstrings are the plugin reference.

A plugin is a plain module (or object) with functions named like the hooks below, decorated with
``@tracerl.hookimpl``, published under the ``tracerl`` entry-point group::

    [project.entry-points.tracerl]
    my_judge = "my_package.tracerl_plugin"

Versioning: this module's :data:`HOOKSPEC_VERSION` is raised whenever a hook changes in an
incompatible way. A plugin may declare ``TRACERL_PLUGIN_API = N``; tracerl refuses to load a
plugin whose N is newer than it knows, with an error naming the plugin. New hooks and new
keyword arguments are added compatibly: an implementation may accept any subset of a hook's
arguments, so older plugins keep working.

Hooks may return awaitables where noted; tracerl awaits them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from ..rollout.model import Model
    from .trajectory import LLMCall, Trajectory, TrajectoryGroup

PROJECT = "tracerl"
HOOKSPEC_VERSION = 1

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# --- backends and engines -------------------------------------------------------------------

@hookspec
def tracerl_engines() -> list[type]:
    """Return inference engine classes. Each has a unique ``name`` and an ``available()``
    classmethod, and implements :class:`tracerl.core.engine.Engine`."""


@hookspec
def tracerl_backends() -> list[type]:
    """Return backend classes. Each has a unique ``name`` and implements
    :class:`tracerl.core.backend.Backend`."""


# --- trajectory capture -----------------------------------------------------------------------

@hookspec
def tracerl_on_llm_call(call: LLMCall) -> None:
    """Called by the gateway after it recorded one LLM call (token ids, logprobs, latency).
    Runs on the gateway's event loop: keep it fast, never block."""


@hookspec
def tracerl_on_trajectory_end(trajectory: Trajectory) -> None:
    """Called when a rollout has produced its trajectory and its LLM calls are attached."""


# --- reward and judging -----------------------------------------------------------------------

@hookspec(firstresult=True)
def tracerl_score_group(group: TrajectoryGroup, judge: str | None) -> Any:
    """Score a group: return an awaitable of the scored group, or None to let another plugin
    handle it. ``judge`` names the judge wanted (None: any)."""


# --- training lifecycle -----------------------------------------------------------------------

@hookspec
def tracerl_before_train_step(
    model: Model, step: int, groups: list[TrajectoryGroup], config: Any
) -> None:
    """Called before a training step on ``groups`` (already written to disk). The local
    backend calls the training and logging hooks from a worker thread, so they may block
    without stalling inference; with a remote backend they run on the client (and the
    server's own plugins on the server)."""


@hookspec
def tracerl_after_train_step(model: Model, step: int, metrics: dict[str, float]) -> None:
    """Called once the checkpoint of ``step`` is saved and served."""


# --- logging ----------------------------------------------------------------------------------

@hookspec
def tracerl_log_metrics(model: Model, step: int, split: str, metrics: dict[str, float]) -> None:
    """Send aggregate metrics of a step (``split`` is 'train', 'val', ...) to a logger."""


@hookspec
def tracerl_log_trajectories(
    model: Model, step: int, split: str, groups: list[TrajectoryGroup]
) -> None:
    """Send the trajectories of a step to a logger."""
