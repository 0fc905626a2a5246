"""A server-side plugin for the crash tests: stops a training request at its k-th disk commit.

Loaded with ``tracerl serve --plugin tests.faults_crash_plugin``. It wraps ``os.replace`` and
``os.fsync`` (every durable write of tracerl.core.storage goes through one of them: a rename
makes a file or checkpoint appear, an fsync follows every append and every file written). The
request named by ``TRACERL_TEST_CRASH_REQUEST`` arms it when its marker first appears; from then
on each of those calls is a fault point, numbered from 0. At point ``TRACERL_TEST_CRASH_AT`` the
server writes ``TRACERL_TEST_CRASH_MARKER`` (naming the point) and stalls before the call, so
the test can kill it there with SIGKILL. Every point passed is appended to
``TRACERL_TEST_CRASH_LOG`` when set (the test reads the list of points of a whole step)."""

from __future__ import annotations

import os
import threading
import time

_request = os.environ.get("TRACERL_TEST_CRASH_REQUEST", "")
_stop_at = int(os.environ.get("TRACERL_TEST_CRASH_AT", "-1"))
_marker = os.environ.get("TRACERL_TEST_CRASH_MARKER", "")
_log = os.environ.get("TRACERL_TEST_CRASH_LOG", "")
_state = {"armed": False, "count": 0}
_lock = threading.Lock()
_replace, _fsync = os.replace, os.fsync


def _where(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return f"fd {fd}"


def _point(what: str) -> None:
    with _lock:
        if not _state["armed"]:
            return
        k = _state["count"]
        _state["count"] += 1
    if _log:
        with open(_log, "a") as f:
            f.write(f"{k} {what}\n")
    if k == _stop_at:
        with open(_marker, "w") as f:
            f.write(f"{k} {what}")
        time.sleep(3600)  # the injected fault: stalled here until the test kills the server


def replace(src, dst, *args, **kwargs):
    if _request and str(dst).endswith(f"/requests/train/{_request}.json"):
        with _lock:
            _state["armed"] = True
    _point(f"replace {os.path.basename(str(src))} -> {dst}")
    return _replace(src, dst, *args, **kwargs)


def fsync(fd):
    _point(f"fsync {_where(fd)}")
    return _fsync(fd)


if _request:
    os.replace, os.fsync = replace, fsync
