"""Built-in logger plugin: one line per logged step on stderr (off with TRACERL_QUIET=1)."""

from __future__ import annotations

import os
import sys
from typing import Any

from ..core.hookspecs import hookimpl

_SHOWN = ("reward", "reward_std", "loss", "num_trajectories", "num_exceptions", "seconds")


@hookimpl
def tracerl_log_metrics(model: Any, step: int, split: str, metrics: dict[str, float]) -> None:
    if os.environ.get("TRACERL_QUIET") == "1":
        return
    shown = ", ".join(f"{k}={metrics[k]:.4g}" for k in _SHOWN if k in metrics)
    print(f"[tracerl] {model.name} step {step} {split}: {shown}", file=sys.stderr)
