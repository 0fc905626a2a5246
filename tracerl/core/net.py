"""Loopback addresses, free ports and child process groups: shared by every server tracerl
starts (the gateway, ``tracerl serve``, vLLM, the LiteLLM proxy)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


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
