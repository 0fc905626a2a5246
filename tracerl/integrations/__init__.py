"""Framework adapters and logger plugins."""

from __future__ import annotations

import os


def logger_enabled(name: str) -> bool:
    """Whether ``TRACERL_LOGGERS`` (comma-separated) turns on the logger called ``name``."""
    return name in {x.strip() for x in os.environ.get("TRACERL_LOGGERS", "").split(",")}
