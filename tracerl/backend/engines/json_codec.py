"""Decoding of engine replies: orjson when installed, the standard library otherwise.

A chat answer with per-token logprobs is ~100 bytes of JSON per generated token; at hundreds of
concurrent rollouts, decoding it was the gateway's largest CPU cost (orjson is ~3x faster).
orjson refuses NaN and Infinity, which the standard library (and Python's JSON) accepts, so
those replies take the slow path instead of failing.
"""

from __future__ import annotations

import json
from typing import Any

try:
    import orjson
except ImportError:  # pragma: no cover - orjson ships with the backend extra
    orjson = None  # type: ignore[assignment]  # absent: the standard library decodes


def loads(data: bytes | str) -> Any:
    """Parse JSON; raises ``json.JSONDecodeError`` for what neither parser accepts."""
    if orjson is not None:
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError:
            pass
    return json.loads(data)
