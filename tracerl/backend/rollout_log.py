"""Rollout logs: the per-model event logs the trainer takes finished groups from (the rollout
API's, :mod:`.gateway.rollout_api`, and online mode's live calls, :mod:`.online.live_calls`),
and the rollout API's files, read without the web framework.

An event log is an append-only JSONL file per model, replayed after a restart (a torn last line
skipped); a change is written (fsynced) before it is applied, so nothing changes if the write
fails. Its ``taken`` events are the trainer's cursor: a take under an id seen before gets the
same groups again, so a group is handed out once.

Files of a model's folder: ``external/rollouts.jsonl`` (the rollout API's log: open, reward,
finish, taken), ``spans/{rollout_id}.jsonl`` (a line per span post), ``calls/_late.jsonl``
(calls that arrived for a finished rollout, never in its trajectory).
"""

from __future__ import annotations

import math
import threading
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

from ..core.errors import RequestError
from ..core.spans import Span
from ..core.storage import ModelStore, append_jsonl, read_jsonl, validate_name
from ..core.trajectory import MAX_REWARD

LATE_CALLS = "_late.jsonl"  # in calls/: its name cannot be a rollout id (leading ``_``)


def events_path(store: ModelStore) -> Path:
    """The rollout API's event log of ``store``'s model."""
    return store.root / "external" / "rollouts.jsonl"


def spans_path(store: ModelStore, rollout_id: str) -> Path:
    validate_name("rollout id", rollout_id)
    return store.root / "spans" / f"{rollout_id}.jsonl"


def late_calls_path(store: ModelStore) -> Path:
    return store.root / "calls" / LATE_CALLS


def read_spans(store: ModelStore, rollout_id: str) -> list[Span]:
    """The spans posted for ``rollout_id``, in start order."""
    spans = [Span.model_validate(s) for r in read_jsonl(spans_path(store, rollout_id))
             for s in r.get("spans", [])]
    return sorted(spans, key=lambda s: s.start_time)


def pending_rollout_ids(store: ModelStore) -> set[str]:
    """Rollout API rollouts of ``store`` not handed out yet (their calls are not orphans)."""
    state = ModelRollouts(store)
    return {rid for rid, r in state.rollouts.items() if not r.taken}


# --- the shared shape ------------------------------------------------------------------------

class EventLog(ABC):
    """One model's event log and the state it rebuilds; subclasses apply their own events and
    mark a rollout handed out."""

    taken_key: ClassVar[str]  # the field of a ``taken`` event that holds the take's id

    def __init__(self, store: ModelStore, path: Path) -> None:
        """Replays ``path`` into the state, which subclasses set up before calling this."""
        self.store, self.path = store, path
        self.taken: dict[str, list[list[str]]] = {}  # a take's id -> the groups it got
        for event in read_jsonl(path):
            self._apply(event)

    def write(self, event: dict[str, Any]) -> None:
        """Append ``event`` (fsynced), then apply it: nothing changes if the write fails."""
        append_jsonl(self.path, event)
        self._apply(event)

    def _apply(self, e: dict[str, Any]) -> None:
        if e.get("event") != "taken":
            self._apply_event(e)
            return
        self.taken[e[self.taken_key]] = e["groups"]
        for group in e["groups"]:
            for rollout_id in group:
                self._handed_out(rollout_id)

    def take(self, take_id: str, ready: Callable[[], list[list[str]]], at_least: int
             ) -> list[list[str]]:
        """The groups of take ``take_id``: those it got before, else ``ready()`` marked taken
        (one event) when it holds at least ``at_least`` (and one) groups, else none."""
        if take_id in self.taken:
            return self.taken[take_id]
        ids = ready()
        if len(ids) < max(at_least, 1):
            return []
        self.write({"event": "taken", self.taken_key: take_id, "groups": ids, "at": time.time()})
        return ids

    @abstractmethod
    def _apply_event(self, e: dict[str, Any]) -> None:
        """Apply an event other than ``taken``."""

    @abstractmethod
    def _handed_out(self, rollout_id: str) -> None:
        """Mark ``rollout_id`` handed out (a ``taken`` event names it)."""


L = TypeVar("L", bound=EventLog)


class ModelLogs(Generic[L]):
    """Each model's log, loaded on first use; ``lock`` guards them all (the gateway's loop, its
    writer threads and the trainer's thread share them)."""

    def __init__(self, load: Callable[[ModelStore], L]) -> None:
        self.lock = threading.Lock()
        self.loaded: dict[Path, L] = {}  # by the model's folder
        self._load = load

    def of(self, store: ModelStore) -> L:
        """``store``'s log, loaded now if it was not (hold ``lock``)."""
        state = self.loaded.get(store.root)
        if state is None:
            state = self.loaded[store.root] = self._load(store)
        return state


# --- the rollout API's log -------------------------------------------------------------------

@dataclass
class ExternalRollout:
    """One rollout opened through the API (or a live call, as the trainer takes it)."""

    rollout_id: str
    group: str
    group_size: int | None
    metadata: dict[str, Any]
    created_at: float
    reward: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    status: str | None = None  # None while open, then "ok" or "failed"
    error: str | None = None
    finished_at: float | None = None
    taken: bool = False

    def view(self) -> dict[str, Any]:
        return {"rollout_id": self.rollout_id, "group": self.group,
                "group_size": self.group_size, "metadata": self.metadata,
                "reward": self.reward, "metrics": self.metrics,
                "status": self.status or "open", "error": self.error,
                "created_at": self.created_at, "finished_at": self.finished_at,
                "handed_out": self.taken}


class ModelRollouts(EventLog):
    """One model's rollout API rollouts, rebuilt from its event log and kept in step with it."""

    taken_key = "request_id"

    def __init__(self, store: ModelStore) -> None:
        self.rollouts: dict[str, ExternalRollout] = {}
        self.groups: dict[str, list[str]] = {}
        super().__init__(store, events_path(store))

    def _apply_event(self, e: dict[str, Any]) -> None:
        if e.get("event") == "open":
            opened = ExternalRollout(e["rollout_id"], e["group"], e.get("group_size"),
                                     e.get("metadata") or {}, e["at"])
            self.rollouts[opened.rollout_id] = opened
            self.groups.setdefault(opened.group, []).append(opened.rollout_id)
            return
        r = self.rollouts.get(e.get("rollout_id", ""))
        if r is None:
            return
        if e.get("reward") is not None:
            r.reward = float(e["reward"])
        r.metrics.update(e.get("metrics") or {})
        if e.get("event") == "finish":
            r.status, r.error, r.finished_at = e["status"], e.get("error"), e["at"]

    def _handed_out(self, rollout_id: str) -> None:
        if rollout_id in self.rollouts:
            self.rollouts[rollout_id].taken = True

    def ready_groups(self) -> list[list[str]]:
        """Groups whose rollouts are all finished (``group_size`` of them when it was given)
        and none handed out yet, oldest first."""
        ready = []
        for ids in self.groups.values():
            rollouts = [self.rollouts[i] for i in ids]
            size = rollouts[0].group_size
            if any(r.taken or r.status is None for r in rollouts):
                continue
            if size is not None and len(rollouts) < size:
                continue
            ready.append(ids)
        return sorted(ready, key=lambda ids: max(self.rollouts[i].finished_at or 0 for i in ids))

    def counts(self) -> dict[str, int]:
        c = Counter("handed_out" if r.taken else "open" if r.status is None else "finished"
                    for r in self.rollouts.values())
        return {"open": c["open"], "finished": c["finished"], "handed_out": c["handed_out"],
                "ready_groups": len(self.ready_groups())}


# --- rewards as the logs take them -----------------------------------------------------------

def invalid(param: str, message: str) -> RequestError:
    """A 400 naming the body field ``param`` (the gateway's answer carries it)."""
    return RequestError(f"{param}: {message}", param=param)


def finite_number(value: Any, param: str) -> float:
    """``value`` as a float, refused (naming ``param``) unless it is a finite number."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise invalid(param, f"must be a finite number, got {value!r}")
    return float(value)


def reward_number(value: Any, param: str = "reward") -> float:
    """A reward, refused (naming ``param``) unless a finite number within ``±MAX_REWARD``
    (:data:`~tracerl.core.trajectory.MAX_REWARD`: a group's sums and variances stay finite)."""
    reward = finite_number(value, param)
    if abs(reward) > MAX_REWARD:
        raise invalid(param, f"{value!r} is beyond ±{MAX_REWARD:g}: rewards that large overflow "
                             "a group's mean and variance; scale them down")
    return reward


def metrics_of(value: Any) -> dict[str, float]:
    """A body's ``metrics`` (None: none), refused unless a JSON object of finite numbers."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise invalid("metrics", f"must be a JSON object of numbers, got {value!r}")
    return {str(k): finite_number(v, f"metrics.{k}") for k, v in value.items()}
