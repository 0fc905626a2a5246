"""The remote backend's wire format, shared by server and client (no web framework here).

Uploads of trajectory groups are NDJSON: a first line holding a JSON object of parameters, then
one group per line, the same lines as ``trajectories/{split}/{step}.jsonl`` on disk. Training
progress comes back as NDJSON events. Errors are ``{"error": {"message", "type", "code"}}``; the
code is the error's in :mod:`tracerl.core.errors`, whose table the client reads it back with.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from ..core import strict_json
from ..core.errors import InvalidTrajectoryError, RequestError
from ..core.trajectory import TrajectoryGroup, group_lines, parse_group_lines

API_PREFIX = "/api/v1"
NDJSON = "application/x-ndjson"


def encode_groups(params: dict[str, Any], groups: Iterable[TrajectoryGroup]) -> bytes:
    """An upload: the parameters line, then one group per line."""
    return (json.dumps(params, allow_nan=False) + "\n" + group_lines(groups)).encode()


def decode_groups(body: bytes) -> tuple[dict[str, Any], list[TrajectoryGroup]]:
    """Parse an upload; errors name the line that is wrong, and the field that cannot be
    recorded (:mod:`tracerl.core.strict_json`)."""
    try:
        text = body.decode()
    except UnicodeDecodeError as e:
        raise InvalidTrajectoryError(f"upload is not UTF-8: {e}") from None
    lines = text.split("\n")
    if not lines[0].strip():
        raise InvalidTrajectoryError("upload must start with a parameters line, then groups")
    try:
        params = strict_json.loads(lines[0])  # a value that cannot be recorded: its field named
    except RequestError:
        raise
    except ValueError as e:
        raise InvalidTrajectoryError(f"upload:1: the parameters line is not JSON: {e}") from None
    for lineno, line in enumerate(lines[1:], 2):
        try:
            strict_json.check_document(line)
        except ValueError as e:
            raise InvalidTrajectoryError(f"upload:{lineno}: not a valid trajectory group: {e}"
                                         ) from None
    if not isinstance(params, dict):
        raise InvalidTrajectoryError("upload:1: the parameters line must be a JSON object")
    return params, parse_group_lines(lines[1:], "upload", first_lineno=2)
