"""The catalog: task name -> where its :class:`Task` is, from the ``tracerl_tasks`` hook.

tracerl's own tasks register through that hook as the built-in plugin ``tasks`` (this module,
listed in ``BUILTIN_PLUGINS``); a third-party plugin adds its own the same way. A task's module
is imported only when the task is asked for, so listing the catalog imports none of them.
"""

from __future__ import annotations

import importlib
import importlib.util

from ..core.errors import ConfigError
from ..events.hookspecs import hookimpl
from ..events.plugins import collect_tasks
from .base import Task

# tracerl's own tasks: name -> "module:attribute" of its Task
BUILTIN_TASKS = {
    "tool-products": "tracerl.tasks.tool_products:TASK",
    "game-guess-number": "tracerl.tasks.game_guess_number:TASK",
    "node-chain-sum": "tracerl.tasks.node_chain_sum:TASK",
    "art-tic-tac-toe": "tracerl.tasks.art_tic_tac_toe:TASK",
}
TASK_NAMES = tuple(sorted(BUILTIN_TASKS))  # tracerl's own; task_names() adds plugins' tasks


@hookimpl
def tracerl_tasks() -> dict[str, str]:
    return dict(BUILTIN_TASKS)


def task_names() -> tuple[str, ...]:
    """Every task of the catalog, tracerl's and its plugins', sorted."""
    return tuple(sorted(collect_tasks()))


def _load(name: str, reference: str) -> Task:
    """The Task at ``module:attribute`` (``module`` alone: its ``TASK``)."""
    module, _, attribute = reference.partition(":")
    attribute = attribute or "TASK"
    try:
        task = getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"task {name}: cannot load {reference}: {e}") from e
    if not isinstance(task, Task):
        raise ConfigError(f"{module}.{attribute} is not a tracerl.tasks.Task")
    return task


def get_task(name: str) -> Task:
    """The task called ``name``; ConfigError naming the catalog for an unknown one, and what
    to install for a missing library (the task's ``requires``)."""
    catalog = collect_tasks()
    if name not in catalog:
        raise ConfigError(f"unknown task {name!r}; the catalog: {', '.join(sorted(catalog))}")
    task = _load(name, catalog[name])
    missing = [m for m in task.requires if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(f"task {name} needs {', '.join(missing)}"
                          + (f": {task.install}" if task.install else ""))
    return task
