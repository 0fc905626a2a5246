"""``strip_logprobs``: nested data without its ``logprobs`` (ART's, to store less)."""

from __future__ import annotations

import copy
import logging
from typing import Any

log = logging.getLogger(__name__)


def strip_logprobs(obj: Any) -> Any:
    """A deep copy of ``obj`` whose dicts lose their ``"logprobs"`` keys and whose objects get
    ``logprobs = None``; ``obj`` itself is returned unchanged if it cannot be copied."""
    try:
        copied = copy.deepcopy(obj)
    except Exception as e:  # an object that refuses deepcopy: nothing is stripped (as ART)
        log.warning("strip_logprobs could not copy a %s (%s); returned unchanged",
                    type(obj).__name__, e)
        return obj
    return _strip(copied)


def _strip(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _strip(v) for k, v in obj.items() if k != "logprobs"}
    if isinstance(obj, list | tuple):
        items = [_strip(v) for v in obj]
        return tuple(items) if isinstance(obj, tuple) else items
    if hasattr(obj, "__dict__"):
        for key, value in list(vars(obj).items()):
            setattr(obj, key, None if key == "logprobs" else _strip(value))
    return obj
