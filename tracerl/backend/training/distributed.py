"""The distributed trainer, coordinator side: a policy that ``train_step`` drives like the
one-process :class:`~.trainer.Trainer`, whose ranks (``rank.py``) run elsewhere.

The step's rows are cut into the same length-bucketed micro-batches as in one process, dealt
round-robin to the ranks (a rank with one fewer gets an idle slot), and every rank's loss is
normalised by the whole step's trained tokens (or rows): the gradient the ranks sum is the
one-process gradient. Checkpoints are gathered by every rank and written once, from rank 0's
files, into the step's atomic folder. A rank that dies ends the step with
:class:`~tracerl.core.errors.RankFailedError` naming it; the policy is then closed, and the
next step starts fresh ranks from the newest checkpoint.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from multiprocessing.connection import Connection, Listener, wait
from pathlib import Path
from queue import Empty, Queue
from typing import Any, cast

from ...core.config import DistributedTrainerConfig, LoraConfig, TrainConfig
from ...core.errors import ConfigError, RankFailedError, TrainingError
from ...core.launcher import Launcher
from ...events.plugins import collect_classes
from .policy import Rendering
from .rank import COORDINATOR_ENV, COORDINATOR_KEY_ENV
from .rows import Row
from .trainer import load_tokenizer
from .update import micro_batches, step_totals

log = logging.getLogger(__name__)
RANK_MODULE = "tracerl.backend.training.rank"
# after one rank fails, how long the others get to report (a dead rank's connection closes at
# once; the survivors fail in their next collective or are stopped by the launcher)
FAILURE_GRACE_S = 10.0


def _ready(conns: list[Connection], timeout: float) -> list[Connection]:
    """``multiprocessing.connection.wait`` on connections: those of them that are ready."""
    return cast("list[Connection]", wait(conns, timeout=timeout))  # it returns what it got


def make_launcher(config: DistributedTrainerConfig) -> Launcher:
    """The launcher plugin ``config.launcher`` names."""
    launchers = collect_classes("tracerl_launchers")
    if config.launcher not in launchers:
        raise ConfigError(f"unknown launcher {config.launcher!r} (DistributedTrainerConfig."
                          f"launcher); available: {sorted(launchers)}")
    cls = launchers[config.launcher]
    if not cls.available():
        raise ConfigError(f"launcher {config.launcher!r} is not available here: install "
                          f"tracerl[{config.launcher}]")
    return cls(config)


def deal(batches: list[list[Row]], world_size: int) -> list[list[list[Row]]]:
    """Micro-batches dealt round-robin to ranks, each list padded with empty (idle) slots to
    the same length: every rank runs as many forward/backward passes as the others."""
    slots = -(-len(batches) // world_size)
    return [batches[r::world_size] + [[]] * (slots - len(batches[r::world_size]))
            for r in range(world_size)]


def checkpoint_files(folder: Path) -> dict[str, bytes]:
    """A checkpoint's files, to send to ranks that may be on other machines."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


class DistributedPolicy(Rendering):
    """The policy of a model trained by ``config.world_size`` ranks (same interface as
    :class:`~.trainer.Trainer` for ``train_step``: render, tokenize, optimize, save, close)."""

    def __init__(self, config: DistributedTrainerConfig, launcher: Launcher, model_path: Path,
                 lora: LoraConfig, adapter_path: Path | None, chat_template: str | None,
                 log_path: Path) -> None:
        self.config, self.launcher = config, launcher
        self.tokenizer = load_tokenizer(model_path, chat_template)
        self.phase = "starting"
        self.ranks: dict[int, dict[str, Any]] = {}  # rank -> its hello (pid, host)
        self._conns: dict[int, Connection] = {}
        key = secrets.token_bytes(32)
        self._listener = Listener((launcher.coordinator_host(), 0), authkey=key)
        host, port = self._listener.address
        try:
            launcher.start_ranks(RANK_MODULE, {
                COORDINATOR_ENV: f"{host}:{port}", COORDINATOR_KEY_ENV: key.hex(),
                "TRACERL_RANK_DEVICE": config.device, "TRACERL_DISABLE_UNSLOTH": "1",
            }, log_path)
            self._accept(config.start_timeout_s)
            self._run("load", lambda rank: {
                "strategy": config.strategy, "model_path": str(model_path),
                "lora": lora.model_dump(), "chat_template": chat_template,
                "adapter_files": checkpoint_files(adapter_path) if adapter_path else {},
                "timeout_s": config.step_timeout_s}, config.start_timeout_s)
        except BaseException:
            self.close()
            raise
        self.phase = "ready"

    # --- the Trainer interface of train_step (render/tokenize: Rendering) -------------------

    def optimize(self, rows: list[Row], config: TrainConfig) -> dict[str, float]:
        """The step on the ranks: the one-process micro-batches, dealt round-robin."""
        batches = micro_batches(rows, config.micro_batch_tokens)
        shares = deal(batches, self.config.world_size)
        totals = step_totals(batches)
        results = self._run("update", lambda rank: {
            "batches": shares[rank], "totals": totals, "config": config.model_dump()},
            self.config.step_timeout_s)
        return results[0]

    def save(self, out_dir: Path) -> None:
        """Every rank gathers the checkpoint; rank 0's files land in ``out_dir`` (the step's
        atomic folder), written once."""
        files = self._run("save", lambda rank: None, self.config.step_timeout_s)[0]
        for name, data in files.items():
            (Path(out_dir) / name).write_bytes(data)

    def close(self) -> None:
        """Stop the ranks (asked first, then by their launcher) and the listener."""
        for conn in self._conns.values():
            try:
                conn.send(("close", None))
            except OSError:
                pass
        deadline = time.monotonic() + 10
        pending = list(self._conns.values())
        while pending and time.monotonic() < deadline:
            for conn in _ready(pending, max(0.0, deadline - time.monotonic())):
                pending.remove(conn)
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()
        self.launcher.stop()
        self._listener.close()
        self.phase = "closed"

    # --- talking to the ranks -------------------------------------------------------------

    def _accept(self, timeout_s: float) -> None:
        """Wait for every rank's hello (accepting in a thread, so that a launcher failure or
        the deadline ends the wait)."""
        arrived: Queue[Connection | BaseException] = Queue()

        def accept() -> None:
            for _ in range(self.config.world_size):
                try:
                    arrived.put(self._listener.accept())
                except BaseException as e:  # the listener closed, a bad authkey
                    arrived.put(e)
                    return

        threading.Thread(target=accept, name="tracerl-rank-accept", daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while len(self._conns) < self.config.world_size:
            failure = self.launcher.failure()
            if failure is not None:
                raise TrainingError(f"the trainer ranks did not start: {failure}")
            if time.monotonic() > deadline:
                raise TrainingError(
                    f"waited {timeout_s:.0f} s for {self.config.world_size} trainer ranks to "
                    f"connect; {len(self._conns)} did (DistributedTrainerConfig.start_timeout_s)")
            try:
                conn = arrived.get(timeout=0.2)
            except Empty:
                continue
            if isinstance(conn, BaseException):
                raise TrainingError(f"a trainer rank could not connect: {conn}") from conn
            _, hello = conn.recv()
            self.ranks[hello["rank"]] = hello
            self._conns[hello["rank"]] = conn

    def _run(self, command: str, payload: Any, timeout_s: float) -> dict[int, Any]:
        """Send ``command`` to every rank (``payload(rank)``) and collect the answers; a rank
        that dies or fails raises :class:`RankFailedError` naming it (the policy is closed)."""
        self.phase = command
        try:
            for rank, conn in sorted(self._conns.items()):
                conn.send((command, payload(rank)))
            results = self._collect(command, timeout_s)
        except RankFailedError:
            self.close()
            raise
        except (OSError, EOFError) as e:
            self.close()
            raise RankFailedError(f"lost the connection to the trainer ranks during "
                                  f"{command!r}: {e}") from e
        self.phase = "ready"
        return results

    def _collect(self, command: str, timeout_s: float) -> dict[int, Any]:
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}     # rank -> traceback, or why it was stopped
        dead: list[int] = []            # ranks whose connection closed without an answer
        by_conn = {conn: rank for rank, conn in self._conns.items()}
        pending = dict(by_conn)
        deadline = time.monotonic() + timeout_s
        while pending:
            now = time.monotonic()
            if now > deadline:
                if errors or dead:
                    break
                raise RankFailedError(
                    f"trainer ranks {sorted(pending.values())} did not answer {command!r} "
                    f"within {timeout_s:.0f} s (DistributedTrainerConfig.step_timeout_s)",
                    rank=min(pending.values()))
            for conn in _ready(list(pending), min(0.5, deadline - now)):
                rank = pending.pop(conn)
                try:
                    status, value = conn.recv()
                except (EOFError, OSError):
                    dead.append(rank)
                    continue
                if status == "ok":
                    results[rank] = value
                else:
                    errors[rank] = value
            if (errors or dead) and deadline > time.monotonic() + FAILURE_GRACE_S:
                deadline = time.monotonic() + FAILURE_GRACE_S  # the others' last word
            if pending and not (errors or dead) and self.launcher.failure() is not None:
                deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
        if not (errors or dead or pending):
            return results
        raise self._failure(command, errors, dead, sorted(pending.values()))

    def _failure(self, command: str, errors: dict[int, str], dead: list[int],
                 silent: list[int]) -> RankFailedError:
        """The error naming the rank that failed first: one that died without a word, else
        one that raised (a rank stopped by the launcher says so, and is not the cause)."""
        world = self.config.world_size
        launcher = self.launcher.failure() or "the launcher reports nothing yet"
        resume = ("the step's groups are saved: the next step starts fresh ranks from the "
                  "newest checkpoint (backend.pending_groups(model) gives them back)")
        if dead:
            rank = dead[0]
            who = self.ranks.get(rank, {})
            return RankFailedError(
                f"trainer rank {rank} of {world} (pid {who.get('pid')} on {who.get('host')}) "
                f"died during {command!r}: its connection closed without an answer; "
                f"{launcher}; {resume}", rank=rank)
        raised = {r: e for r, e in errors.items() if not e.startswith("stopped by")}
        if raised:
            rank = min(raised)
            last = raised[rank].strip().splitlines()[-1]
            return RankFailedError(f"trainer rank {rank} of {world} failed during {command!r}: "
                                   f"{last}; {resume}\n{raised[rank]}", rank=rank)
        rank = min(silent or errors)
        return RankFailedError(f"trainer rank {rank} of {world} stopped answering during "
                               f"{command!r}; {launcher}; {resume}", rank=rank)


def start_distributed_policy(config: DistributedTrainerConfig, model_path: Path,
                             lora: LoraConfig, adapter_path: Path | None,
                             chat_template: str | None, log_path: Path) -> DistributedPolicy:
    """Ranks started by the launcher ``config`` names, loaded from ``adapter_path`` (the
    newest checkpoint; None: a fresh adapter, rank 0's initialisation)."""
    return DistributedPolicy(config, make_launcher(config), model_path, lora, adapter_path,
                             chat_template, log_path)
