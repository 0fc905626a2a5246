"""Old import path of :mod:`tracerl.backend.online.release` (kept for users' code)."""

from .online.release import ReleaseControl, canary_bucket

__all__ = ["ReleaseControl", "canary_bucket"]
