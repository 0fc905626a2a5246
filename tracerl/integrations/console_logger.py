"""Built-in logger plugin: one line per logged step on stderr (off with TRACERL_QUIET=1).

It logs through the ``tracerl.console`` logger, to which it attaches a stderr handler of its own
when none is configured, so the lines show without any logging set-up and can be redirected
like any other log.
"""

from __future__ import annotations

import logging
import sys

from ..core.model_spec import ModelSpec
from ..events.hookspecs import hookimpl

SHOWN = ("reward", "reward_std", "loss", "num_trajectories", "num_exceptions", "seconds")


class ConsoleLogger:
    """``[tracerl] MODEL step N SPLIT: reward=..., loss=...`` per logged step."""

    def __init__(self) -> None:
        self.log = logging.getLogger("tracerl.console")
        if not self.log.handlers:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("[tracerl] %(message)s"))
            self.log.addHandler(handler)
            self.log.setLevel(logging.INFO)
            self.log.propagate = False

    @hookimpl
    def tracerl_log_metrics(self, model: ModelSpec, step: int, split: str,
                            metrics: dict[str, float]) -> None:
        # a split without the usual keys (e.g. the async pipeline's) shows its first ones
        keys = [k for k in SHOWN if k in metrics] or list(metrics)[:8]
        shown = ", ".join(f"{k}={metrics[k]:.4g}" for k in keys)
        self.log.info("%s step %d %s: %s", model.name, step, split, shown)
