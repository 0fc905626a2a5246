"""Strict JSON for what arrives from outside: only values that can be recorded as they came.

:func:`loads` refuses what a record could not hold or a reader could not read back, naming the
field (``messages[0].content``, ``metadata.a``): ``NaN`` and ``Infinity`` and numbers that
overflow to them (``1e999``); lone UTF-16 surrogates (``"\\ud800"``: valid JSON, but not
Unicode, so not UTF-8); integers outside 64 bits (``10**300``: no int64 column, orjson or
torch holds one). Bodies are pre-screened on their bytes, so a clean one is not walked.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from .errors import RequestError

INT_MIN, INT_MAX = -(2**63), 2**64 - 1  # int64 below, uint64 above (a seed may be unsigned)
# what may hide a bad value: a surrogate's escape or raw bytes, an integer of 19+ digits, an
# exponent that may overflow, a constant
_SUSPECT = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]|\d{19}|[eE]\+?\d{3}|NaN|Infinity")


def _printable(text: str) -> str:
    """``text`` with any lone surrogate written as its escape (so it can be shown)."""
    return text.encode("utf-8", "backslashreplace").decode()


def _is_text(value: str) -> bool:
    try:
        value.encode()
    except UnicodeEncodeError:
        return False
    return True


def _problem(value: Any) -> str | None:
    if isinstance(value, _HugeInt):
        return f"is an integer outside 64 bits ({len(value)} digits)"
    if isinstance(value, str):
        return None if _is_text(value) else "holds a lone surrogate (not valid Unicode)"
    if isinstance(value, float):
        return None if math.isfinite(value) else f"{value!r} is not a finite number (strict JSON)"
    if isinstance(value, int) and not isinstance(value, bool) and not INT_MIN <= value <= INT_MAX:
        return "is an integer outside 64 bits"
    return None


def find_unrecordable(value: Any) -> tuple[str, str] | None:
    """The first value in ``value`` that cannot be recorded, as ``(field path, why)``; None
    when there is none. Iterative: a body nested as deep as the parser allows is walked too."""
    todo: list[tuple[str, Any]] = [("", value)]
    while todo:
        path, item = todo.pop()
        if isinstance(item, dict):
            for key, child in item.items():
                where = f"{path}.{_printable(key)}" if path else _printable(key)
                if not _is_text(key):
                    return where, "its key holds a lone surrogate (not valid Unicode)"
                todo.append((where, child))
        elif isinstance(item, list):
            todo.extend((f"{path}[{i}]", child) for i, child in enumerate(item))
        elif (why := _problem(item)) is not None:
            return path, why
    return None


def loads(raw: bytes | str, name: str | None = None) -> Any:
    """``raw`` parsed as strict JSON; ``ValueError`` for invalid JSON, :class:`RequestError`
    naming the field that cannot be recorded, ``NaN`` included (``name``: see
    :func:`check_recordable`)."""
    nonfinite = False

    def parse_float(text: str) -> float:  # also NaN, Infinity, -Infinity: found by the walk
        nonlocal nonfinite
        value = float(text)
        nonfinite = nonfinite or not math.isfinite(value)
        return value

    try:
        value = json.loads(raw, parse_constant=parse_float, parse_float=parse_float)
    except ValueError:
        if not _suspect(raw):
            raise
        # an integer past Python's digit limit stops the parse: parse again, keeping such a
        # number as a marker, so the refusal names its field (``reward``), not the body
        value = json.loads(raw, parse_constant=parse_float, parse_float=parse_float,
                           parse_int=_parse_int)
    if nonfinite or _suspect(raw):
        check_recordable(value, name)
    return value


class _HugeInt(str):
    """An integer literal too long to convert (the marker :func:`loads` refuses by field)."""


def _parse_int(text: str) -> int | _HugeInt:
    return _HugeInt(text) if len(text) > 4000 else int(text)


def _suspect(raw: bytes | str) -> bool:
    return _SUSPECT.search(raw.encode("utf-8", "surrogatepass") if isinstance(raw, str)
                           else raw) is not None


def check_document(raw: bytes | str, name: str | None = None) -> None:
    """Raise as :func:`loads` does for a JSON document another parser reads (a pydantic model's
    line, say); parsed here only when its bytes may hide such a value."""
    if _suspect(raw):
        loads(raw, name)


def check_recordable(value: Any, name: str | None = None) -> None:
    """Raise :class:`RequestError` naming the first field of ``value`` that cannot be recorded;
    ``name``: what ``value`` is (a header, say), the field path inside it then in the message."""
    found = find_unrecordable(value)
    if found is None:
        return
    path, why = found
    if name is None:
        raise RequestError(f"{path or 'the body'}: {why}", param=path or None)
    raise RequestError(f"{name}{': ' + path if path else ''}: {why}", param=name)
