"""The release log: which policy version serves a model's plain name, and why, append-only.

``{model folder}/releases.jsonl``, one record per line, each appended and fsynced
(:func:`~tracerl.core.storage.append_jsonl`) before it takes effect. Records (``event``):

``candidate``  version ``step`` proposed against the ``incumbent``
``shadow``     the held-out replay's ``evidence`` and ``verdict`` (pass / fail)
``canary``     ``share`` of new rollouts routed to the candidate from now on
``gate``       the canary's ``evidence`` and ``verdict`` (promote / rollback / hold / continue)
               with the gates ``tripped``
``rejected``   the candidate is rolled back (``reason``); the incumbent never changed
``begin``      intent: ``action`` (promote / rollback / adopt) to ``step``, ``from`` the incumbent
``commit``     the ``action`` of the last ``begin`` is done: ``step`` is the incumbent from here
``recovered``  found at start: a ``begin`` without its ``commit`` (a crash); ``aborted`` names
               it, and the ``incumbent`` stays the last committed one

Crash consistency: the incumbent is the ``step`` of the last ``commit``; a promotion is a
``begin``, the adapter loaded, then a ``commit``, and only then routed. A process killed
anywhere restarts on one incumbent: the committed one (:meth:`ReleaseLog.recover` appends the
``recovered`` record that says so). A torn last line (killed mid-append) is skipped.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .storage import ModelStore, append_jsonl, read_jsonl

log = logging.getLogger(__name__)

RELEASES = "releases.jsonl"
ACTIONS = ("promote", "rollback", "adopt")


@dataclass
class ReleaseState:
    """The log replayed: the incumbent, the candidate in flight and its stage."""

    incumbent: int | None = None  # None: no release committed yet
    candidate: int | None = None
    stage: str = "none"  # none, shadow, canary, held
    share: float = 0.0  # of new rollouts routed to the candidate
    pending: dict[str, Any] | None = None  # a begin without its commit
    records: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)  # the commits, oldest first

    def held(self) -> dict[int, str]:
        """The checkpoints the log still points at, step -> why: the incumbent, the candidate,
        and both ends of a move in progress. :func:`delete_checkpoints` never deletes them."""
        held: dict[int, str] = {}
        if self.pending is not None:
            held[int(self.pending["step"])] = f"the target of a {self.pending.get('action')} " \
                                              "in progress"
        if self.candidate is not None:
            held[self.candidate] = f"the release candidate ({self.stage})"
        if self.incumbent is not None:
            held[self.incumbent] = "the release incumbent (it serves the model's name)"
        return {step: why for step, why in held.items() if step > 0}


class ReleaseLog:
    """One model's release log (``path``: the model's folder)."""

    def __init__(self, model_root: Path) -> None:
        self.path = Path(model_root) / RELEASES

    def exists(self) -> bool:
        return self.path.exists()

    def records(self) -> list[dict[str, Any]]:
        return read_jsonl(self.path)

    def append(self, event: str, **fields: Any) -> dict[str, Any]:
        """Append one record (fsynced when this returns)."""
        record = {"seq": len(self.records()), "time": time.time(), "event": event, **fields}
        append_jsonl(self.path, record)
        return record

    def state(self) -> ReleaseState:
        """Replay the records."""
        s = ReleaseState()
        for r in self.records():
            s.records += 1
            event = r.get("event")
            if event == "candidate":
                s.candidate, s.stage, s.share = int(r["step"]), "shadow", 0.0
            elif event == "canary" and s.candidate == r.get("step"):
                s.stage, s.share = "canary", float(r["share"])
            elif event in ("shadow", "gate") and r.get("verdict") == "hold":
                s.stage, s.share = "held", 0.0
            elif event == "begin":
                s.pending = r
            elif event == "commit":
                s.incumbent, s.pending = int(r["step"]), None
                s.history.append(r)
                if s.candidate is not None:
                    s.candidate, s.stage, s.share = None, "none", 0.0
            elif event == "rejected" and s.candidate == r.get("step"):
                s.candidate, s.stage, s.share = None, "none", 0.0
            elif event == "recovered":
                s.pending = None
                s.candidate, s.stage, s.share = None, "none", 0.0
        return s

    def recover(self) -> ReleaseState:
        """At start: a ``begin`` without its ``commit`` is recorded as aborted (the incumbent
        stays the last committed one); returns the state to serve."""
        s = self.state()
        if s.pending is not None:
            self.append("recovered", aborted={k: s.pending[k] for k in ("action", "step", "from")
                                              if k in s.pending},
                        incumbent=s.incumbent)
            s = self.state()
        return s

    def begin(self, action: str, step: int, incumbent: int | None, **evidence: Any
              ) -> dict[str, Any]:
        if action not in ACTIONS:
            raise ConfigError(f"release action must be one of {ACTIONS}, not {action!r}")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ConfigError(f"release step must be an integer >= 0, not {step!r}")
        return self.append("begin", action=action, step=step, **{"from": incumbent}, **evidence)

    def commit(self, action: str, step: int) -> dict[str, Any]:
        return self.append("commit", action=action, step=step)


def delete_checkpoints(store: ModelStore, keep: set[int]) -> tuple[list[int], dict[int, str]]:
    """Delete ``store``'s checkpoints not in ``keep``, except the newest
    (:meth:`~.storage.ModelStore.delete_checkpoints`) and those its release log still points at
    (:meth:`ReleaseState.held`: deleting the incumbent would leave nothing to serve after a
    restart); those are kept and a warning names them and why. Returns the deleted steps and
    the kept ones (step -> why)."""
    held = ReleaseLog(store.root).state().held() if ReleaseLog(store.root).exists() else {}
    steps = set(store.checkpoint_steps())
    kept = {step: why for step, why in held.items() if step in steps and step not in keep}
    if kept:
        log.warning("%s/%s: kept checkpoints %s, which the release log points at: %s",
                    store.project, store.name, sorted(kept),
                    "; ".join(f"{s}: {why}" for s, why in sorted(kept.items())))
    return store.delete_checkpoints(set(keep) | set(kept)), kept
