"""ART's ``art.local``: ``from art.local import LocalBackend`` becomes
``from tracerl.local import LocalBackend`` (this import loads the backend: torch, FastAPI).

- ``backend.py``: ART's ``art.local.backend`` path of the same class.
"""

from .backend import LocalBackend

__all__ = ["LocalBackend"]
