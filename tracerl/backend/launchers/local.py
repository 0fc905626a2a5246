"""The ``local`` launcher: the ranks as subprocesses of ``torch.distributed.run`` (torchrun) on
this host, one per GPU (or CPU process). torchrun watches them: when one dies it stops the
others and exits, naming the failed rank and its exit code in its log."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import IO

from ...core import settings
from ...core.launcher import Launcher
from ...core.net import free_port, start_child, stop_process_group
from ...events.hookspecs import hookimpl

STOP_GRACE_S = 10.0
# torchrun's failure summary: "rank      : 1 (local_rank: 1)" ... "exitcode  : -9 (pid: 123)"
_FAILED_RANK = re.compile(r"rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", re.S)


def log_tail(path: Path, lines: int = 15) -> str:
    """The last ``lines`` lines of a log file ('' when there is none)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class LocalLauncher(Launcher):
    """``python -m torch.distributed.run --nproc-per-node N -m MODULE`` in a process group."""

    name = "local"
    process: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    _log: IO[bytes] | None = None

    def start_ranks(self, module: str, env: dict[str, str], log_path: Path) -> None:
        world = self.config.world_size
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path, self._log = log_path, open(log_path, "ab")
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
                   "--nproc-per-node", str(world), "--master-addr", "127.0.0.1",
                   "--master-port", str(free_port()), "--max-restarts", "0",
                   "--monitor-interval", "0.1", "-m", module]
        # CPU ranks: one thread each unless told otherwise (torchrun's own default too)
        self.process = start_child(  # torchrun stops its ranks when it is stopped
            command, env={**os.environ, "OMP_NUM_THREADS": settings.OMP_NUM_THREADS.get(),
                          **env},
            stdout=self._log, stderr=subprocess.STDOUT)

    def failure(self) -> str | None:
        if self.process is None or self.process.poll() is None:
            return None
        tail = log_tail(self.log_path) if self.log_path else ""
        found = _FAILED_RANK.search(tail)
        who = (f"torchrun reports rank {found.group(1)} failed with exit code {found.group(2)}"
               if found else f"torchrun exited with {self.process.returncode}")
        return f"{who} (log: {self.log_path})"

    def stop(self) -> None:
        if self.process is not None:
            stop_process_group(self.process, STOP_GRACE_S)
        if self._log is not None:
            self._log.close()
            self._log = None


@hookimpl
def tracerl_launchers() -> list[type]:
    return [LocalLauncher]
