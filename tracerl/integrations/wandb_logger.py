"""Weights & Biases logger plugin: metric curves per step and trajectory tables.

Enabled by ``TRACERL_LOGGERS`` containing ``wandb`` (comma-separated). One W&B run per model
(project = the model's project, name = its name). Works offline with ``WANDB_MODE=offline``.
Metrics are logged as ``{split}/{name}`` at the model's step.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from ..core.hookspecs import hookimpl
from . import logger_enabled

_runs: dict[tuple[str, str], Any] = {}
_lock = threading.Lock()


def enabled() -> bool:
    return logger_enabled("wandb")


def _run(model: Any) -> Any:
    import wandb

    key = (model.project, model.name)
    with _lock:
        if key not in _runs:
            _runs[key] = wandb.init(project=model.project, name=model.name, reinit="create_new",
                                    config={"base_model": model.base_model,
                                            **model.config.model_dump(mode="json")})
        return _runs[key]


@hookimpl
def tracerl_log_metrics(model: Any, step: int, split: str, metrics: dict[str, float]) -> None:
    if enabled():
        _run(model).log({f"{split}/{k}": v for k, v in metrics.items()}, step=step)


@hookimpl
def tracerl_log_trajectories(model: Any, step: int, split: str, groups: list[Any]) -> None:
    if not enabled():
        return
    import wandb

    table = wandb.Table(columns=["group", "rollout_id", "reward", "messages", "metrics"])
    for gi, group in enumerate(groups):
        for t in group.trajectories:
            table.add_data(gi, t.rollout_id or "", t.reward, json.dumps(t.messages(), default=str),
                           json.dumps(t.metrics))
    _run(model).log({f"{split}/trajectories": table}, step=step)


def finish_all() -> None:
    """Close every run (flushes offline files)."""
    with _lock:
        runs = list(_runs.values())
        _runs.clear()
    for run in runs:
        run.finish()
