"""tasks: a catalog of agent tasks from libraries nobody here wrote, to show and measure an
agent learning (``pip install 'tracerl[tasks]'``). Nothing here is imported by the core: the
catalog sits on top, using the public API as a user does. The plugin manager imports this
package for ``catalog.py``, whose ``tracerl_tasks`` hook names the tasks without importing them.

- ``base.py``: :class:`Task` (items in a train and a disjoint held-out split, an agent, its
  library's scorer) and :func:`split_of`.
- ``catalog.py``: the tasks by name, tracerl's and plugins' (the ``tracerl_tasks`` hook;
  :func:`get_task`, :func:`task_names`, :data:`TASK_NAMES`: tracerl's own).
- ``runner.py``: :func:`evaluate` (held-out, logged as ``val``) and :func:`train_task`.
- ``evaluation.py``: ``tracerl eval`` (the held-out split at chosen steps, each step served).
- one module per task: ``tool_products.py`` (reasoning-gym, LangGraph),
  ``game_guess_number.py`` (textarena, OpenAI Agents SDK), ``node_chain_sum.py``
  (reasoning-gym, a Node agent through the rollout API), ``art_tic_tac_toe.py`` (ART's
  example, ART API).
"""

from __future__ import annotations

from .base import Item, Task, split_of
from .catalog import TASK_NAMES, get_task, task_names
from .runner import TaskRun, evaluate, train_task

__all__ = ["TASK_NAMES", "Item", "Task", "TaskRun", "evaluate", "get_task", "split_of",
           "task_names", "train_task"]
