"""Loopback addresses, free ports and child processes: shared by every server tracerl starts
(the gateway, ``tracerl serve``, vLLM, the LiteLLM proxy) and every process it starts (vLLM
servers, the LiteLLM proxy, torchrun and its trainer ranks): :func:`start_child` starts each,
:func:`stop_process_group` stops it."""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import functools
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any, cast

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
PR_SET_PDEATHSIG = 1  # linux/prctl.h

_spawner_lock = threading.Lock()
_spawner: concurrent.futures.ThreadPoolExecutor | None = None


def is_loopback(host: str | None) -> bool:
    """Whether ``host`` names this machine only (servers may bind there without a key)."""
    return host in LOOPBACK_HOSTS


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the OS picks it)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]  # (host, port) for IPv4, (host, port, flow, scope) for v6
        return port


def stop_process_group(process: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM the process group of ``process`` (started with ``start_new_session``), then
    SIGKILL it if it has not exited within ``grace_s``; waits for the exit either way."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _die_with_parent(prctl: Callable[[int, int], int], parent: int
                     ) -> None:  # pragma: no cover - runs in the child, between fork and exec
    """Ask Linux to SIGTERM this child when its parent dies, even by SIGKILL; if the parent
    died before the request (nothing would signal then), SIGTERM it now."""
    prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)


def _spawner_thread() -> concurrent.futures.ThreadPoolExecutor:
    """The one thread that forks every child: it lives as long as this process."""
    global _spawner
    with _spawner_lock:
        if _spawner is None:
            _spawner = concurrent.futures.ThreadPoolExecutor(1, "tracerl-spawner")
        return _spawner


def start_child(command: Sequence[str], **popen: Any) -> subprocess.Popen[bytes]:
    """Start ``command`` (``popen``: :class:`subprocess.Popen`'s other arguments) in a session
    of its own, so that :func:`stop_process_group` stops its whole tree, and make it die with
    this process: on Linux it is sent SIGTERM when this process ends, even by SIGKILL
    (``PR_SET_PDEATHSIG``). Linux sends that signal when the *thread* that forked the child
    ends, so every child is forked by one thread that lives as long as the process: a child
    started from a short-lived worker thread (``asyncio.to_thread``) is not killed with it."""
    if not sys.platform.startswith("linux"):
        return cast("subprocess.Popen[bytes]",
                    subprocess.Popen(list(command), start_new_session=True, **popen))
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here, not in the forked child
    preexec = functools.partial(_die_with_parent, prctl, os.getpid())
    def fork() -> subprocess.Popen[bytes]:
        return cast("subprocess.Popen[bytes]", subprocess.Popen(
            list(command), start_new_session=True, preexec_fn=preexec, **popen))

    return _spawner_thread().submit(fork).result()
