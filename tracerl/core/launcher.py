"""The launcher contract: who starts the ranks of a distributed trainer, and where the
inference replicas run. Launchers are plugins (hook ``tracerl_launchers``); tracerl ships
``local`` (torchrun subprocesses on this host) and ``ray`` (Ray actors in placement groups).

A launcher starts ``world_size`` processes that each run ``python -m <module>`` with torchrun's
environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``) plus the variables it is given; the ranks then talk to the coordinator (the
backend process) themselves. The launcher only starts, watches and stops them.
"""

from __future__ import annotations

from abc import abstractmethod
from pathlib import Path

from .config import DistributedTrainerConfig
from .engine import Engine, EngineSpec
from .pluggable import Pluggable


class Launcher(Pluggable):
    """Starts, watches and stops the ranks of one distributed trainer (``available()``:
    whether its packages are importable here)."""

    def __init__(self, config: DistributedTrainerConfig) -> None:
        self.config = config

    def coordinator_host(self) -> str:
        """The address ranks reach the coordinator (this process) on."""
        return "127.0.0.1"

    @abstractmethod
    def start_ranks(self, module: str, env: dict[str, str], log_path: Path) -> None:
        """Start ``config.world_size`` processes of ``python -m module`` with torchrun's
        environment plus ``env``; their output goes to ``log_path`` where the launcher can."""

    @abstractmethod
    def failure(self) -> str | None:
        """Why the ranks are gone (which rank, exit code or signal), None while they run."""

    @abstractmethod
    def stop(self) -> None:
        """Stop every rank (idempotent)."""

    def engine(self, engine_class: type[Engine], spec: EngineSpec) -> Engine | None:
        """The engine serving ``spec`` when this launcher places replicas (a proxy to one it
        started elsewhere); None: the backend builds it as without a launcher."""
        return None
