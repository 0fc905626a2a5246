"""A server-side plugin for the release crash test: stalls a promotion at one of its commit
points, so that the test can kill the server there with SIGKILL.

Loaded with ``tracerl serve --plugin tests.release_crash_plugin``. It wraps the release log's
append (``tracerl.core.release_log.append_jsonl``, the fsynced write of each record); the
``begin`` and ``commit`` records of a promotion make four points: 0 before the begin record,
1 after it (before the version is loaded), 2 before the commit record (the version loaded),
3 after it (before the new incumbent is routed). At point ``TRACERL_TEST_CRASH_AT`` the
server writes ``TRACERL_TEST_CRASH_MARKER`` (naming the point) and stalls."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from tracerl.core import release_log

_stop_at = int(os.environ.get("TRACERL_TEST_CRASH_AT", "-1"))
_marker = os.environ.get("TRACERL_TEST_CRASH_MARKER", "")
_append = release_log.append_jsonl
_points = {("begin", False): 0, ("begin", True): 1, ("commit", False): 2, ("commit", True): 3}


def _point(event: str, after: bool) -> None:
    k = _points.get((event, after))
    if k is not None and k == _stop_at and _marker:
        Path(_marker).write_text(str(k))
        threading.Event().wait()  # stalled until killed


def _append_with_points(path, record):
    event = record.get("event") if isinstance(record, dict) else None
    if event in ("begin", "commit") and record.get("action") == "promote":
        _point(event, False)
        _append(path, record)
        _point(event, True)
        return
    _append(path, record)


release_log.append_jsonl = _append_with_points
