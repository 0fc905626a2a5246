"""ART's ``art.local.backend``: ``from art.local.backend import LocalBackend``."""

from ..backend.local import LocalBackend

__all__ = ["LocalBackend"]
