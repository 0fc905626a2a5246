"""ART's ``art.local``: ``from art.local import LocalBackend`` becomes
``from tracerl.local import LocalBackend`` (this import loads the backend: torch, FastAPI)."""

from .backend.local import LocalBackend

__all__ = ["LocalBackend"]
