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
READY = "tracerl serve: ready"


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
        mark = self.log.read_text().count(READY) if self.log.exists() else 0
        with open(self.log, "a") as log:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         cwd=ROOT, start_new_session=True)
        self.wait_for_log_line(READY, after=mark, timeout_s=timeout)
        return self

    def wait_for_log_line(self, line: str, *, after: int = 0, timeout_s: float = 240) -> None:
        """Poll the server's log (every 0.1 s, up to ``timeout_s``) until ``line`` appears more
        than ``after`` times; fail naming the line awaited, with the log's tail, if the process
        exits first or time runs out."""
        deadline = time.monotonic() + timeout_s
        while self.log.read_text().count(line) <= after:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tracerl serve exited with code {self.proc.returncode} "
                                   f"before logging {line!r}:\n{self.log.read_text()[-4000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"waited {timeout_s} s for tracerl serve to log {line!r}:\n"
                                   f"{self.log.read_text()[-4000:]}")
            time.sleep(0.1)

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


async def registered_on(url: str, name: str, project: str, config: object) -> object:
    """A SmolLM2 ``TrainableModel`` registered on the server at ``url`` through a
    ``RemoteBackend`` with the test key (close it with ``model.backend.close()``)."""
    import tracerl

    model = tracerl.TrainableModel(name=name, project=project, base_model="smollm2",
                                   config=config)
    await model.register(tracerl.RemoteBackend(url, api_key=API_KEY))
    return model
