"""Live calls: the production calls of a model in online mode, and the feedback that arrives for
them later (:mod:`.online` trains on them).

A plain call (no rollout id) to a model in online mode is given a rollout id of its own,
``live-<hex>``: release control's sticky canary hash routes it like any rollout, and its record
is kept in ``calls/live-<hex>.jsonl``. The caller keys its feedback by the response id it got
(the chat completion's ``id``)::

    POST /v1/feedback/{response_id}   {"reward": 0.7, "metrics"?: {...}}
                                      or {"thumbs": "up" | "down"}  (reward 1.0 / 0.0)
    GET  /v1/feedback/{response_id}   the live call's state

The body is validated before anything is written (400 naming the field); an id no live call
was answered with is a 404 naming it; feedback for a call that has its reward already, or that
expired, is a 409 naming it. State is an append-only event log per model, ``online/live.jsonl``
(an :class:`..rollout_log.EventLog`: fsynced records, replayed after a restart, a torn last line
skipped):

``call``      ``rollout_id``, ``response_id``, ``task`` (its task key), ``step`` (the version
              that served it), ``at``: written with the call's record, before the caller gets
              its answer (a call recorded but not logged, a crash between the two, is logged at
              the next start from its record)
``feedback``  ``response_id``, ``reward``, ``metrics``, ``at``
``expired``   ``rollout_ids`` and the ``reason`` (``ttl``, ``count``, ``rejected``)
``taken``     ``batch`` (an id; a batch taken again gets the same groups) and its ``groups``

A call's **task key** (what makes calls comparable in a group) is its ``x-tracerl-tags`` tag
``task`` when given, else a digest of its messages (the same prompt).

An agent's episode spans several calls (a tool call, then the answer): tagged with the same
``session`` (``{"task": ..., "session": "<the episode's id>"}``), they are one live rollout,
``live-<digest of the session>``: the canary routes them to one version, each call's ``call``
event maps its response id to that rollout, one feedback (keyed by any of them) is its reward,
and it trains as one multi-call trajectory. It expires as rejected if any of its calls was
served by a rolled-back version.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse

from ...core.errors import (
    ConfigError,
    FeedbackClosedError,
    RequestError,
    ResponseNotFoundError,
    TracerlError,
)
from ...core.storage import ModelStore, read_jsonl, validate_name
from ...core.trajectory import LLMCall, rewards_spread
from ..gateway.request_body import parse_json_object, read_limited_body
from ..rollout_log import (
    EventLog,
    ExternalRollout,
    ModelLogs,
    invalid,
    metrics_of,
    reward_number,
)

if TYPE_CHECKING:
    from ..gateway.served import ModelTable

log = logging.getLogger(__name__)

LIVE_PREFIX = "live-"
MAX_BODY_BYTES = 64 * 1024
THUMBS = {"up": 1.0, "down": 0.0}


def live_rollout_id(tags: dict[str, Any] | None = None) -> str:
    """A plain call's live rollout id: one of its own, or, for a call tagged ``session``, the
    session's (every call of an agent's episode joins one rollout, which its reward is for)."""
    session = (tags or {}).get("session")
    if session is None:
        return LIVE_PREFIX + uuid.uuid4().hex
    return LIVE_PREFIX + hashlib.sha256(json.dumps(session).encode()).hexdigest()[:32]


def events_path(store: ModelStore) -> Path:
    return store.root / "online" / "live.jsonl"


def task_key(call: LLMCall) -> str:
    """What makes calls comparable: the ``task`` call tag, else the digest of the messages."""
    tags = call.metadata.get("tags") or {}
    if tags.get("task") is not None:
        return f"task:{tags['task']}"
    prompt = json.dumps(call.request.get("messages", call.request.get("prompt")),
                        sort_keys=True, default=str)
    return "prompt:" + hashlib.sha256(prompt.encode()).hexdigest()[:16]


@dataclass
class LiveCall:
    """One live call and what became of it."""

    rollout_id: str
    response_id: str  # the first call's
    task: str
    step: int | None  # the version that served the first call
    at: float
    reward: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    rewarded_at: float | None = None
    expired: str | None = None  # the reason
    taken: bool = False
    steps: set[int | None] = field(default_factory=set)  # of every call (a session: several)

    @property
    def waiting(self) -> bool:
        return not self.taken and self.expired is None

    def view(self) -> dict[str, Any]:
        state = ("expired" if self.expired else "trained" if self.taken
                 else "rewarded" if self.reward is not None else "waiting for feedback")
        return {"response_id": self.response_id, "rollout_id": self.rollout_id,
                "task": self.task, "served_by": self.step, "at": self.at, "state": state,
                "reward": self.reward, "metrics": self.metrics, "expired": self.expired}

    def as_rollout(self, group_size: int) -> ExternalRollout:
        """The call as a finished rollout (for :func:`..gateway.rollout_api.build_groups`)."""
        return ExternalRollout(self.rollout_id, self.task, group_size,
                               {"live": True, "task": self.task, "response_id": self.response_id},
                               self.at, reward=self.reward, metrics=dict(self.metrics),
                               status="ok", finished_at=self.rewarded_at, taken=True)


class _ModelLive(EventLog):
    """One model's live calls, rebuilt from its event log (and its call records) on load."""

    taken_key = "batch"

    def __init__(self, store: ModelStore) -> None:
        self.calls: dict[str, LiveCall] = {}  # by rollout id, oldest first
        self.by_response: dict[str, str] = {}
        self.expired = Counter[str]()
        super().__init__(store, events_path(store))
        self._log_unlogged_calls()

    def _log_unlogged_calls(self) -> None:
        """Calls recorded but not logged (a crash between the two writes): logged now."""
        calls_dir = self.store.root / "calls"
        logged = Counter(self.by_response.values())  # calls logged, per rollout
        for path in sorted(calls_dir.glob(LIVE_PREFIX + "*.jsonl")) if calls_dir.exists() else []:
            if logged[path.stem] and path.read_bytes().count(b"\n") == logged[path.stem]:
                continue  # every record of it logged (one per line): nothing to parse
            for record in read_jsonl(path):
                if (record.get("response") or {}).get("id") in self.by_response:
                    continue
                event = call_event(LLMCall.model_validate(record))
                if event is not None:
                    self.write(event)

    def _apply_event(self, e: dict[str, Any]) -> None:
        kind = e.get("event")
        if kind == "call":  # a session's later call joins its rollout
            c = self.calls.get(e["rollout_id"]) or LiveCall(
                e["rollout_id"], e["response_id"], e["task"], e.get("step"), e["at"])
            c.steps.add(e.get("step"))
            self.calls[c.rollout_id] = c
            self.by_response[e["response_id"]] = c.rollout_id
        elif kind == "feedback":
            c = self.calls[self.by_response[e["response_id"]]]
            c.reward, c.metrics, c.rewarded_at = float(e["reward"]), e.get("metrics") or {}, e["at"]
        elif kind == "expired":
            for rid in e["rollout_ids"]:
                c = self.calls[rid]
                c.expired = e["reason"]
                self.expired[e["reason"] if c.reward is None or
                             e["reason"] in ("rejected", "no_signal") else "ungrouped"] += 1

    def _handed_out(self, rollout_id: str) -> None:
        self.calls[rollout_id].taken = True

    def full_groups(self, group_size: int) -> list[list[str]]:
        """Full groups of rewarded waiting calls that share a task key, oldest first."""
        by_task: dict[str, list[str]] = {}
        for c in self.calls.values():
            if c.waiting and c.reward is not None:
                by_task.setdefault(c.task, []).append(c.rollout_id)
        groups = [ids[i:i + group_size] for ids in by_task.values()
                  for i in range(0, len(ids) - group_size + 1, group_size)]
        return sorted(groups, key=lambda ids: max(self.calls[i].rewarded_at or 0 for i in ids))

    def has_signal(self, group: list[str], tolerance: float | None) -> bool:
        """Whether ``group``'s rewards spread by more than ``tolerance`` (None: any group)."""
        return tolerance is None or rewards_spread(
            (self.calls[i].reward or 0.0 for i in group), tolerance)

    def ready_groups(self, group_size: int, tolerance: float | None = None) -> list[list[str]]:
        """The full groups to train on: those whose rewards spread by more than
        ``tolerance`` (None: all)."""
        return [g for g in self.full_groups(group_size) if self.has_signal(g, tolerance)]

    def counts(self) -> dict[str, int]:
        waiting = [c for c in self.calls.values() if c.waiting]
        return {"calls": len(self.calls),
                "waiting_for_feedback": sum(c.reward is None for c in waiting),
                "rewarded_waiting": sum(c.reward is not None for c in waiting),
                "trained": sum(c.taken for c in self.calls.values()),
                "expired_unrewarded": self.expired["ttl"] + self.expired["count"],
                "expired_ungrouped": self.expired["ungrouped"],
                "expired_rejected_version": self.expired["rejected"],
                "expired_no_signal": self.expired["no_signal"],
                "batches": len(self.taken)}


def call_event(call: LLMCall) -> dict[str, Any] | None:
    """The ``call`` event of a live call's record (None: not a live call, or no answer)."""
    response_id = (call.response or {}).get("id")
    if not (call.rollout_id or "").startswith(LIVE_PREFIX) or not isinstance(response_id, str) \
            or call.error is not None:
        return None
    return {"event": "call", "rollout_id": call.rollout_id, "response_id": response_id,
            "task": task_key(call), "step": call.adapter_step, "at": call.created_at}


def _feedback(body: dict[str, Any]) -> tuple[float, dict[str, float]]:
    """The reward and metrics of a feedback body, validated (nothing written yet)."""
    unknown = set(body) - {"reward", "thumbs", "metrics"}
    if unknown:
        raise invalid(sorted(unknown)[0], "is not a feedback field (reward, thumbs, metrics)")
    if ("reward" in body) == ("thumbs" in body):
        raise invalid("reward", "give exactly one of reward (a number) or thumbs (up or down)")
    if "thumbs" in body:
        if body["thumbs"] not in THUMBS:
            raise invalid("thumbs", f"must be 'up' or 'down', got {body['thumbs']!r}")
        reward = THUMBS[body["thumbs"]]
    else:
        reward = reward_number(body["reward"])
    return reward, metrics_of(body.get("metrics"))


class LiveCalls:
    """Live calls per model in online mode, the feedback route, expiry and batches."""

    def __init__(self, models: ModelTable) -> None:
        self.models = models
        # shared by the gateway's loop, its writer threads and the online loop
        self._logs = ModelLogs(_ModelLive)

    def enable(self, store: ModelStore) -> dict[str, int]:
        """Keep the live calls of ``store``'s model (loads its log); returns its counts."""
        with self._logs.lock:
            return self._logs.of(store).counts()

    def recorded(self, store: ModelStore, call: LLMCall) -> None:
        """The recorder's hook (a writer thread, after the call's record is on disk): log a
        live call of a model in online mode."""
        if store.root not in self._logs.loaded:
            return
        event = call_event(call)
        if event is not None:
            with self._logs.lock:
                self._logs.loaded[store.root].write(event)

    def _find(self, response_id: str) -> tuple[_ModelLive, LiveCall]:
        for state in self._logs.loaded.values():
            rid = state.by_response.get(response_id)
            if rid is not None:
                return state, state.calls[rid]
        raise ResponseNotFoundError(
            f"no live call was answered with response id {response_id!r} on this gateway "
            "(feedback is taken for the chat completion ids of a model in online mode, as the "
            "caller got them)")

    def feedback(self, response_id: str, reward: float, metrics: dict[str, float]) -> LiveCall:
        with self._logs.lock:
            state, call = self._find(response_id)
            if call.expired is not None:
                raise FeedbackClosedError(
                    f"response {response_id} expired ({call.expired}: "
                    f"{EXPIRY_REASONS[call.expired]}); its feedback is no longer taken")
            if call.reward is not None:
                raise FeedbackClosedError(f"response {response_id} has its feedback already "
                                          f"(reward {call.reward}); it is final")
            state.write({"event": "feedback", "response_id": response_id, "reward": reward,
                         "metrics": metrics, "at": time.time()})
            return call

    def view(self, response_id: str) -> dict[str, Any]:
        with self._logs.lock:
            return self._find(response_id)[1].view()

    def expire(self, store: ModelStore, *, ttl_s: float, max_pending: int,
               keep_steps: Collection[int] | None = None, now: float | None = None
               ) -> dict[str, int]:
        """Expire the waiting calls served by a version not in ``keep_steps`` (a rolled-back
        candidate; None: keep all), older than ``ttl_s``, then the oldest beyond
        ``max_pending``; one event per reason. Returns the counts."""
        now = time.time() if now is None else now
        with self._logs.lock:
            state = self._logs.of(store)
            waiting = [c for c in state.calls.values() if c.waiting]
            doomed: dict[str, list[str]] = {"rejected": [], "ttl": [], "count": []}
            for c in waiting:
                rejected = keep_steps is not None and any(
                    step is not None and step not in keep_steps for step in c.steps)
                reason = "rejected" if rejected else "ttl" if c.at < now - ttl_s else None
                if reason:
                    doomed[reason].append(c.rollout_id)
            left = [c for c in waiting if c.rollout_id not in
                    {*doomed["rejected"], *doomed["ttl"]}]
            doomed["count"] = [c.rollout_id for c in left[:max(len(left) - max_pending, 0)]]
            for reason, ids in doomed.items():
                if ids:
                    state.write({"event": "expired", "rollout_ids": ids, "reason": reason,
                                 "at": now})
                    log.info("%d live calls of %s expired (%s)", len(ids), store.root.name,
                             EXPIRY_REASONS[reason])
            return state.counts()

    def expire_equal_groups(self, store: ModelStore, group_size: int, tolerance: float
                            ) -> int:
        """Expire the calls of full groups whose rewards spread by at most ``tolerance`` (no
        GRPO signal: DAPO's dynamic sampling), one event; returns how many calls."""
        with self._logs.lock:
            state = self._logs.of(store)
            ids = [i for g in state.full_groups(group_size)
                   if not state.has_signal(g, tolerance) for i in g]
            if ids:
                state.write({"event": "expired", "rollout_ids": ids, "reason": "no_signal",
                             "at": time.time()})
                log.info("%d live calls of %s expired (%s)", len(ids), store.root.name,
                         EXPIRY_REASONS["no_signal"])
            return len(ids)

    def ready(self, store: ModelStore, group_size: int, tolerance: float | None = None) -> int:
        """Full groups ready to train on (with a spread of rewards above ``tolerance``)."""
        with self._logs.lock:
            return len(self._logs.of(store).ready_groups(group_size, tolerance))

    def has_batch(self, store: ModelStore, batch: str) -> bool:
        with self._logs.lock:
            return batch in self._logs.of(store).taken

    def take(self, store: ModelStore, n_groups: int, group_size: int, batch: str,
             tolerance: float | None = None) -> list[list[ExternalRollout]]:
        """Up to ``n_groups`` ready groups (a spread of rewards above ``tolerance``), marked
        taken (one fsynced event); a ``batch`` id taken before gets the same groups again."""
        validate_name("batch id", batch)
        with self._logs.lock:
            state = self._logs.of(store)
            ids = state.take(batch, lambda: state.ready_groups(group_size, tolerance)[:n_groups],
                             1)
            return [[state.calls[i].as_rollout(group_size) for i in group] for group in ids]

    def rewards_since(self, store: ModelStore, since: float) -> dict[str, float]:
        """Rollout id -> reward of the live calls served from ``since`` on that have one."""
        with self._logs.lock:
            return {c.rollout_id: c.reward for c in self._logs.of(store).calls.values()
                    if c.at >= since and c.reward is not None}

    def counts(self, store: ModelStore) -> dict[str, int]:
        with self._logs.lock:
            return self._logs.of(store).counts()

    def install(self, app: FastAPI, answer_error: Callable[[TracerlError], JSONResponse]
                ) -> None:
        """Serve the feedback routes (:data:`router`) on the gateway's ``app`` (under its API
        key); errors are answered by ``answer_error``."""
        app.state.live_calls, app.state.live_calls_errors = self, answer_error
        app.include_router(router)


EXPIRY_REASONS = {
    "ttl": "no feedback and group within TRACERL_ONLINE_REWARD_TTL_S of the call",
    "count": "more live calls waiting than TRACERL_ONLINE_MAX_PENDING; the oldest went",
    "rejected": "served by a candidate that was rolled back",
    "no_signal": "its group's rewards were all equal, no GRPO signal "
                 "(OnlineConfig.equal_rewards_tolerance)",
}


def _valid_id(response_id: str) -> None:
    try:
        validate_name("response id", response_id)
    except ConfigError as e:
        raise invalid("response_id", str(e)) from None


# --- routes ----------------------------------------------------------------------------------

router = APIRouter()


def _live(request: Request) -> tuple[LiveCalls, Callable[[TracerlError], JSONResponse]]:
    """The gateway's live calls and its error answer (set by :meth:`LiveCalls.install`)."""
    return request.app.state.live_calls, request.app.state.live_calls_errors


@router.post("/v1/feedback/{response_id}")
async def post_feedback(request: Request, response_id: str) -> Any:
    live, answer_error = _live(request)
    try:
        raw = await read_limited_body(request, MAX_BODY_BYTES)
        try:
            body = parse_json_object(raw or b"{}")
        except RequestError as e:  # a field that cannot be recorded keeps its name
            raise (e if e.param else invalid("body", str(e))) from None
        reward, metrics = _feedback(body)
        _valid_id(response_id)
        call = await asyncio.to_thread(live.feedback, response_id, reward, metrics)
        return call.view()
    except TracerlError as e:
        return answer_error(e)


@router.get("/v1/feedback/{response_id}")
async def get_feedback(request: Request, response_id: str) -> Any:
    live, answer_error = _live(request)
    try:
        _valid_id(response_id)
        return live.view(response_id)
    except TracerlError as e:
        return answer_error(e)
