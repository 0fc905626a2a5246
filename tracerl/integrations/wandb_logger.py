"""Weights & Biases logger plugin: metric curves per step and trajectory tables.

Registered when ``TRACERL_LOGGERS`` names ``wandb``. One W&B run per model (project = the
model's project, name = its name), logged as ``{split}/{name}`` at the model's step. Works
offline with ``WANDB_MODE=offline``; :meth:`WandbLogger.finish` closes the runs.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from ..core.model_spec import ModelSpec
from ..core.trajectory import TrajectoryGroup
from ..events.hookspecs import hookimpl


class WandbLogger:
    """Holds one W&B run per model."""

    def __init__(self) -> None:
        self._runs: dict[str, Any] = {}
        self._lock = threading.Lock()

    def run(self, model: ModelSpec) -> Any:
        """The model's run, started on first use."""
        import wandb

        with self._lock:
            if model.key not in self._runs:
                self._runs[model.key] = wandb.init(
                    project=model.project, name=model.name, reinit="create_new",
                    config={"base_model": model.base_model,
                            **model.config.model_dump(mode="json")})
            return self._runs[model.key]

    @hookimpl
    def tracerl_log_metrics(self, model: ModelSpec, step: int, split: str,
                            metrics: dict[str, float]) -> None:
        self.run(model).log({f"{split}/{k}": v for k, v in metrics.items()}, step=step)

    @hookimpl
    def tracerl_log_trajectories(self, model: ModelSpec, step: int, split: str,
                                 groups: list[TrajectoryGroup]) -> None:
        import wandb

        table = wandb.Table(columns=["group", "rollout_id", "reward", "messages", "metrics"])
        for gi, group in enumerate(groups):
            for t in group.trajectories:
                table.add_data(gi, t.rollout_id or "", t.reward,
                               json.dumps(t.messages(), default=str), json.dumps(t.metrics))
        self.run(model).log({f"{split}/trajectories": table}, step=step)

    def finish(self) -> None:
        """Close every run (flushes offline files)."""
        with self._lock:
            runs = list(self._runs.values())
            self._runs.clear()
        for run in runs:
            run.finish()
