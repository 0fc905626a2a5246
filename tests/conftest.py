"""Shared fixtures. Heavy fixtures (models, engines, servers) are session-scoped."""

from __future__ import annotations

import os

os.environ.setdefault("TRACERL_QUIET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
