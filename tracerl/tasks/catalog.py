"""The catalog: task name -> the module that defines it (imported when asked for, so listing
the catalog needs none of the tasks' libraries)."""

from __future__ import annotations

import importlib
import importlib.util

from ..core.errors import ConfigError
from .base import Task

# name -> (module, the modules it imports from the `tasks` extra)
CATALOG: dict[str, tuple[str, tuple[str, ...]]] = {
    "tool-products": ("tracerl.tasks.tool_products", ("reasoning_gym", "langgraph", "langchain")),
    "game-guess-number": ("tracerl.tasks.game_guess_number", ("textarena", "agents")),
    "node-chain-sum": ("tracerl.tasks.node_chain_sum", ("reasoning_gym",)),
    "art-tic-tac-toe": ("tracerl.tasks.art_tic_tac_toe", ("openai",)),
}
TASK_NAMES = tuple(sorted(CATALOG))


def get_task(name: str) -> Task:
    """The task called ``name``; ConfigError naming the catalog for an unknown one and the
    extra to install for a missing library."""
    if name not in CATALOG:
        raise ConfigError(f"unknown task {name!r}; the catalog: {', '.join(TASK_NAMES)}")
    module, needs = CATALOG[name]
    missing = [m for m in needs if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(f"task {name} needs {', '.join(missing)}: "
                          "pip install 'tracerl[tasks]'")
    task = importlib.import_module(module).TASK
    if not isinstance(task, Task):
        raise ConfigError(f"{module}.TASK is not a tracerl.tasks.Task")
    return task
