"""A real ``tracerl serve`` process on loopback, for the remote-backend tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
API_KEY = "test-key-" + "x" * 24


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``tracerl serve`` with the transformers engine; ``start`` waits until it is ready."""

    def __init__(self, path: Path, *, port: int | None = None, args: tuple[str, ...] = (),
                 env: dict[str, str] | None = None) -> None:
        self.path, self.port = Path(path), port or free_port()
        self.args, self.env = args, env or {}
        self.proc: subprocess.Popen | None = None
        self.log = self.path / f"server-{self.port}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, *, extra_args: tuple[str, ...] = (), timeout: float = 240) -> ServerProcess:
        self.path.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "TRACERL_API_KEY": API_KEY, **self.env}
        cmd = [
            sys.executable,
            "-m",
            "tracerl",
            "serve",
            "--port",
            str(self.port),
            "--path",
            str(self.path / "data"),
            "--engine",
            "transformers",
            *self.args,
            *extra_args,
        ]
        log = open(self.log, "a")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                     start_new_session=True)
        deadline = time.time() + timeout
        mark = self.log.read_text().count("tracerl serve: ready")
        while self.log.read_text().count("tracerl serve: ready") == mark:
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"tracerl serve did not log 'ready' within {timeout} s:\n"
                                   f"{self.log.read_text()[-4000:]}")
            time.sleep(0.2)
        return self

    def kill9(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill9()
