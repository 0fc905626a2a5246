"""ART's ``art.utils.limit_concurrency`` module path."""

from ..rollout.concurrency import limit_concurrency

__all__ = ["limit_concurrency"]
