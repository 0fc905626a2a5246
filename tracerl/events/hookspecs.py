"""Every hook tracerl calls, in one place; the docstrings are the plugin reference.

A plugin is a plain module (or object) with functions named like the hooks below, decorated with
``@tracerl.hookimpl``, published under the ``tracerl`` entry-point group::

    [project.entry-points.tracerl]
    my_judge = "my_package.tracerl_plugin"

or registered at run time with ``tracerl.events.plugins.register(plugin)``. An implementation
may accept any subset of a hook's arguments, so older plugins keep working when arguments are
added. Every hook is fired from :mod:`tracerl.events.lifecycle` (engines, backends, launchers
and tasks are looked up from :mod:`tracerl.events.plugins`).

Versioning: :data:`HOOKSPEC_VERSION` is raised whenever a hook or a contract it hands out
changes incompatibly. A plugin may declare ``TRACERL_PLUGIN_API = N``; tracerl refuses a plugin
whose N is newer than it knows, with an error naming the plugin. Version 2: backends take a
``ModelSpec`` and yield ``TrainEvent`` objects; hooks get the ``ModelSpec`` as ``model``.

Each hook documents its arguments, when and on which thread it is called, and an example.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from ..core.backend import Backend
    from ..core.config import TrainConfig
    from ..core.context import RolloutContext
    from ..core.engine import Engine
    from ..core.launcher import Launcher
    from ..core.model_spec import ModelSpec
    from ..core.trajectory import LLMCall, Trajectory, TrajectoryGroup

PROJECT = "tracerl"
HOOKSPEC_VERSION = 2

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# --- backends and engines -------------------------------------------------------------------

@hookspec
def tracerl_engines() -> list[type[Engine]]:
    """Return inference engine classes this plugin provides.

    Arguments: none.

    Returns: classes implementing :class:`tracerl.core.engine.Engine`, each with a unique
    ``name`` (what ``EngineConfig(engine=...)`` selects) and an ``available()`` classmethod.

    Called: when a backend picks an engine for a model and by ``tracerl plugins``; on the
    thread that registers the model.

    Example::

        class MyEngine(Engine):  # tracerl.core.engine.Engine
            name = "mine"  # EngineConfig(engine="mine")

        @tracerl.hookimpl
        def tracerl_engines():
            return [MyEngine]
    """


@hookspec
def tracerl_backends() -> list[type[Backend]]:
    """Return backend classes this plugin provides.

    Arguments: none.

    Returns: classes implementing :class:`tracerl.core.backend.Backend` (``register``,
    ``get_step``, ``train_events``, ``log``, ``fetch_calls``), each with a unique ``name``;
    users construct them directly (``MyClusterBackend(...)``) and pass them to
    ``model.register``.

    Called: by ``tracerl plugins`` (which lists them), on the calling thread.

    Example::

        @tracerl.hookimpl
        def tracerl_backends():
            return [MyClusterBackend]
    """


@hookspec
def tracerl_launchers() -> list[type[Launcher]]:
    """Return launcher classes this plugin provides (where a distributed trainer's ranks and
    the inference replicas run).

    Arguments: none.

    Returns: classes implementing :class:`tracerl.core.launcher.Launcher`, each with a unique
    ``name`` (what ``DistributedTrainerConfig(launcher=...)`` selects) and an ``available()``
    classmethod. tracerl ships ``local`` (torchrun subprocesses) and ``ray``.

    Called: when a backend with a ``DistributedTrainerConfig`` is created, and by
    ``tracerl plugins``; on the thread that creates the backend.

    Example::

        @tracerl.hookimpl
        def tracerl_launchers():
            return [SlurmLauncher]  # srun, one task per GPU
    """


@hookspec
def tracerl_protocols() -> list[type]:
    """Return the API protocols this plugin serves on the gateway.

    Arguments: none.

    Returns: classes implementing :class:`tracerl.backend.protocols.base.Protocol`, each with
    a unique ``name``, its POST ``routes`` under ``/v1`` (also served under
    ``/rollouts/{rollout_id}/v1``), the engine ``endpoint`` it is rendered on
    (``"chat.completions"`` or ``"completions"``) and ``begin(body)``, which translates one
    request into an :class:`~tracerl.backend.protocols.base.Exchange`. Every call of every
    protocol is recorded the same token-exact way; the record's metadata carries the
    exchange's ``metadata``. A name or route that another protocol has is refused
    (:class:`~tracerl.core.errors.PluginError`) when the gateway is built.

    Called: once per gateway, when it is built (``LocalBackend()``, ``tracerl serve``), on the
    thread that builds it; each class is instantiated once for that gateway.

    Example::

        @tracerl.hookimpl
        def tracerl_protocols():
            return [MyProtocol]
    """


# --- the task catalog -------------------------------------------------------------------------

@hookspec
def tracerl_tasks() -> dict[str, str]:
    """Return the tasks this plugin adds to the catalog (``tracerl.tasks``).

    Arguments: none.

    Returns: task name (what ``tracerl eval --task`` and ``tracerl.tasks.get_task`` take) ->
    where its :class:`tracerl.tasks.Task` is, as ``"module:attribute"`` (``"module"`` alone:
    its ``TASK``). The module is imported only when the task is asked for, so listing the
    catalog imports no task. A name another plugin gives too is refused
    (:class:`~tracerl.core.errors.PluginError` naming both plugins). tracerl's own tasks come
    from the built-in plugin ``tasks`` (``tracerl/tasks/catalog.py``).

    Called: each time the catalog is read (``get_task``, ``task_names``, ``tracerl eval``), on
    the calling thread; return a constant, import nothing.

    Example::

        @tracerl.hookimpl
        def tracerl_tasks():
            return {"my-task": "my_package.my_task:TASK"}
    """


# --- trajectory capture -----------------------------------------------------------------------

@hookspec
def tracerl_rollout_started(rollout: RolloutContext) -> Callable[[], None] | None:
    """A rollout starts: switch on what records inside it (framework adapters do).

    Arguments:
        rollout (RolloutContext): the rollout that starts; its ``rollout_id``, ``index`` and
            ``group_index``, and ``spans`` where adapters add structure.

    Returns: None, or a function that undoes what the hook did; it is called when a
    ``rollout_scope`` block ends (rollouts run by gather end with their task's context).

    Called: once per rollout, in the rollout's own context (so a ``ContextVar`` set here is
    seen only by that rollout), on the event loop or thread that starts it. Keep it fast.

    Example::

        @tracerl.hookimpl
        def tracerl_rollout_started(rollout):
            token = my_handler.set(Handler(rollout))
            return lambda: my_handler.reset(token)
    """


@hookspec
def tracerl_on_llm_call(call: LLMCall) -> None:
    """The gateway recorded one LLM call.

    Arguments:
        call (LLMCall): the token-exact record: prompt and completion token ids, logprobs,
            the request, latency, ``rollout_id`` (None when unattributed) and ``adapter_step``.

    Called: after the record is on disk, before the caller gets its answer; on the gateway's
    event loop (a thread of the backend process), so keep it fast and never block.

    Example::

        @tracerl.hookimpl
        def tracerl_on_llm_call(call):
            metrics.observe("latency_s", call.latency_s)
    """


@hookspec
def tracerl_on_trajectory_end(trajectory: Trajectory) -> None:
    """A rollout produced its trajectory.

    Arguments:
        trajectory (Trajectory): the rollout's trajectory with its reward, its ``llm_calls``
            (the gateway's records) and ``spans`` attached.

    Called: once per finished rollout, in the user's process, on the event loop that ran the
    rollout; a slow implementation delays the gather.

    Example::

        @tracerl.hookimpl
        def tracerl_on_trajectory_end(trajectory):
            print(trajectory.rollout_id, trajectory.reward)
    """


# --- reward and judging -----------------------------------------------------------------------

@hookspec(firstresult=True)
def tracerl_score_group(
    group: TrajectoryGroup, judge: str | None,
) -> Awaitable[TrajectoryGroup | None] | TrajectoryGroup | None:
    """Score a group of trajectories; the first plugin that answers wins.

    Arguments:
        group (TrajectoryGroup): the trajectories of one scenario, to be given rewards.
        judge (str | None): the judge wanted by name (e.g. ``"ruler"``); None: any judge.

    Returns: an awaitable of the scored group, or None to let another plugin handle it.

    Called: by ``tracerl.events.lifecycle.score_group``, typically from ``after_each`` of
    ``gather_trajectory_groups``, on the user's event loop.

    Example::

        @tracerl.hookimpl
        def tracerl_score_group(group, judge):
            if judge in (None, "length"):
                return score_by_length(group)  # a coroutine
    """


# --- training lifecycle -----------------------------------------------------------------------

@hookspec
def tracerl_before_train_step(model: ModelSpec, step: int, groups: list[TrajectoryGroup],
                              config: TrainConfig) -> None:
    """A training step starts.

    Arguments:
        model (ModelSpec): the model being trained (``name``, ``project``, ``base_model``,
            ``config``).
        step (int): the step being trained (the checkpoint it will produce).
        groups (list[TrajectoryGroup]): the step's data, already written to disk.
        config (TrainConfig): the step's hyper-parameters.

    Called: once per step, in a worker thread, so it may block without stalling inference.
    With a remote backend it runs on the client, and the server's own plugins on the server.

    Example::

        @tracerl.hookimpl
        def tracerl_before_train_step(model, step, groups):
            print(f"{model.name}: training step {step} on {len(groups)} groups")
    """


@hookspec
def tracerl_after_train_step(model: ModelSpec, step: int, metrics: dict[str, float]) -> None:
    """A training step finished: its checkpoint is saved and served.

    Arguments:
        model (ModelSpec): the model that was trained.
        step (int): the step whose checkpoint now serves requests.
        metrics (dict[str, float]): the step's metrics (loss, reward, rows, ...).

    Called: once per step, in a worker thread, on the side that started the step (see
    ``tracerl_before_train_step``).

    Example::

        @tracerl.hookimpl
        def tracerl_after_train_step(model, step, metrics):
            if metrics["loss"] != metrics["loss"]:
                raise SystemExit("NaN loss")
    """


@hookspec
def tracerl_online_batch(model: ModelSpec, step: int, groups: list[TrajectoryGroup]) -> None:
    """Online mode formed a training batch from live calls and their late rewards.

    Arguments:
        model (ModelSpec): the model in online mode.
        step (int): the step the batch will train (its candidate version).
        groups (list[TrajectoryGroup]): the batch: groups of comparable calls (one task key
            each), every trajectory one live call (``metadata["response_id"]``) or rollout-API
            rollout, with its reward. A plugin may change rewards in place (an audit, a
            relabelling; the tests inject a bad candidate this way, by inverting them).

    Called: once per online batch, before its step starts, in a worker thread, in the process
    that runs the online loop (``tracerl serve --online``: the server).

    Example::

        @tracerl.hookimpl
        def tracerl_online_batch(model, step, groups):
            print(f"{model.name}: step {step} from {sum(len(g) for g in groups)} live calls")
    """


# --- logging ----------------------------------------------------------------------------------

@hookspec
def tracerl_log_metrics(model: ModelSpec, step: int, split: str,
                        metrics: dict[str, float]) -> None:
    """Aggregate metrics of a step, for a logger.

    Arguments:
        model (ModelSpec): the model the metrics belong to.
        step (int): the model's step when they were measured.
        split (str): ``"train"`` after a training step, or what ``model.log`` was given
            (``"val"``, ``"test"``...).
        metrics (dict[str, float]): reward mean and spread, counts, per-metric means, losses.

    Called: after every training step and every ``model.log``, in a worker thread.

    Example::

        @tracerl.hookimpl
        def tracerl_log_metrics(model, step, split, metrics):
            my_tracker.log({f"{split}/{k}": v for k, v in metrics.items()}, step=step)
    """


@hookspec
def tracerl_log_trajectories(model: ModelSpec, step: int, split: str,
                             groups: list[TrajectoryGroup]) -> None:
    """The trajectories of a ``model.log`` call, for a logger.

    Arguments:
        model (ModelSpec): the model the trajectories belong to.
        step (int): the model's step when they were gathered.
        split (str): what ``model.log`` was given (``"val"`` by default).
        groups (list[TrajectoryGroup]): the logged groups, with rewards and token records.

    Called: after every ``model.log``, in a worker thread.

    Example::

        @tracerl.hookimpl
        def tracerl_log_trajectories(model, step, split, groups):
            for group in groups:
                store(split, step, group.model_dump_json())
    """
