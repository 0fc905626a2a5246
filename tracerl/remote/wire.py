"""The remote backend's wire format, shared by server and client (no web framework here).

Uploads of trajectory groups are NDJSON: a first line holding a JSON object of parameters, then
one group per line, the same lines as ``trajectories/{split}/{step}.jsonl`` on disk. Training
progress comes back as NDJSON events. Errors are ``{"error": {"message", "type", "code"}}`` with
a ``code`` the client turns back into the matching exception type.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from ..core.errors import (
    AuthenticationError,
    ConfigError,
    InvalidTrajectoryError,
    NotRegisteredError,
    RemoteError,
    TracerlError,
    TrainingError,
)
from ..core.trajectory import TrajectoryGroup, group_lines, parse_group_lines

API_PREFIX = "/api/v1"
NDJSON = "application/x-ndjson"

# error code <-> exception type, for errors that cross the wire
ERROR_CODES: dict[str, type[TracerlError]] = {
    "invalid_trajectory": InvalidTrajectoryError,
    "invalid_config": ConfigError,
    "model_not_registered": NotRegisteredError,
    "training_conflict": TrainingError,
    "training_failed": TrainingError,
    "queue_full": TrainingError,
    "invalid_api_key": AuthenticationError,
}


def error_code(exc: BaseException) -> str:
    """The wire code of an exception raised on the server (its ``code`` attribute, if any)."""
    if isinstance(getattr(exc, "code", None), str) and exc.code in ERROR_CODES:
        return exc.code
    for code, cls in ERROR_CODES.items():
        if type(exc) is cls:
            return code
    return "training_failed" if isinstance(exc, TrainingError) else "server_error"


def exception_for(status: int, payload: Any) -> TracerlError:
    """The exception a client raises for an error response."""
    err = payload.get("error") if isinstance(payload, dict) else None
    message = err.get("message") if isinstance(err, dict) else None
    code = err.get("code") if isinstance(err, dict) else None
    message = message or f"HTTP {status}: {str(payload)[:500]}"
    cls = ERROR_CODES.get(code or "")
    if cls is not None:
        return cls(message)
    if status == 401:
        return AuthenticationError(message)
    return RemoteError(message, status=status, code=code)


def encode_groups(params: dict[str, Any], groups: Iterable[TrajectoryGroup]) -> bytes:
    """An upload: the parameters line, then one group per line."""
    return (json.dumps(params, allow_nan=False) + "\n" + group_lines(groups)).encode()


def decode_groups(body: bytes) -> tuple[dict[str, Any], list[TrajectoryGroup]]:
    """Parse an upload; errors name the line that is wrong."""
    try:
        text = body.decode()
    except UnicodeDecodeError as e:
        raise InvalidTrajectoryError(f"upload is not UTF-8: {e}") from None
    lines = text.split("\n")
    if not lines[0].strip():
        raise InvalidTrajectoryError("upload must start with a parameters line, then groups")
    try:
        params = json.loads(lines[0])
    except json.JSONDecodeError as e:
        raise InvalidTrajectoryError(f"upload:1: the parameters line is not JSON: {e}") from None
    if not isinstance(params, dict):
        raise InvalidTrajectoryError("upload:1: the parameters line must be a JSON object")
    return params, parse_group_lines(lines[1:], "upload", first_lineno=2)
