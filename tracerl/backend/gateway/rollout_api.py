"""The rollout API: a service outside the trainer's process (any language) opens a rollout on
the gateway, makes its calls under it, sets its reward and finishes it; the trainer takes the
finished groups (:meth:`ExternalRollouts.take`).

Routes (on the gateway, so under its API key when it has one)::

    POST /v1/rollouts                 {model, group?, group_size?, metadata?}
                                      -> {rollout_id, base_url, headers}
    GET  /v1/rollouts/{id}
    POST /v1/rollouts/{id}/spans      [span, ...] or {"spans": [...], "model"?}
    POST /v1/rollouts/{id}/reward     {reward, metrics?}
    POST /v1/rollouts/{id}/finish     {reward?, metrics?, status: "ok"|"failed", error?}

Every body is validated before anything is written (400 naming the field); an unknown id is
404, a reward or finish after the finish is 409. State is an append-only event log per model,
``external/rollouts.jsonl`` (open, reward, finish, taken), replayed after a restart; the
``taken`` events are the trainer's cursor, so a rollout is handed out once. Spans are kept in
``spans/{rollout_id}.jsonl`` (a line per post) for any rollout (tracerl's own ones too). A
call that arrives for a finished rollout is recorded apart, in ``calls/_late.jsonl``, never in
its trajectory. The log and these files, and their readers, are :mod:`..rollout_log`'s; here
are the routes (a module-level :data:`router`) and the state they serve.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse

from ...core import settings
from ...core.errors import (
    ConfigError,
    RolloutFinishedError,
    RolloutNotFoundError,
    TracerlError,
)
from ...core.spans import Span, awaited_span_ids, link_spans_to_calls
from ...core.storage import ModelStore, append_jsonl, validate_name
from ...core.trajectory import (
    LLMCall,
    RolloutException,
    Trajectory,
    TrajectoryGroup,
    fill_messages_from_calls,
)
from ..rollout_log import (
    LATE_CALLS,
    ExternalRollout,
    ModelLogs,
    ModelRollouts,
    invalid,
    late_calls_path,
    metrics_of,
    read_spans,
    reward_number,
    spans_path,
)
from .request_body import parse_json_object, read_limited_body
from .served import ModelTable, ServedModel

if TYPE_CHECKING:
    from .recorder import CallStore

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 * 1024 * 1024
MAX_SPANS_PER_POST = 1000
STATUSES = ("ok", "failed")


class ExternalRollouts:
    """The rollout API's state, per model, and its routes on a gateway."""

    def __init__(self, models: ModelTable) -> None:
        """``models``: the gateway's served models (rollouts are opened on one of them)."""
        self.models = models
        self._logs = ModelLogs(ModelRollouts)  # the gateway's loop and the trainer's thread
        self._late_warned = 0
        self._spans_posted = threading.Condition()  # notified after each span post is written

    # --- state -----------------------------------------------------------------------------

    def _find(self, rollout_id: str) -> tuple[ModelRollouts, ExternalRollout]:
        validate_name("rollout id", rollout_id)
        for served in list(self.models.values()):
            state = self._logs.of(served.store)
            if rollout_id in state.rollouts:
                return state, state.rollouts[rollout_id]
        raise RolloutNotFoundError(f"no rollout {rollout_id} was opened on this gateway "
                                   "(POST /v1/rollouts opens one)")

    def view(self, rollout_id: str) -> dict[str, Any]:
        with self._logs.lock:
            return self._find(rollout_id)[1].view()

    def is_finished(self, store: ModelStore, rollout_id: str) -> bool:
        with self._logs.lock:
            r = self._logs.of(store).rollouts.get(rollout_id)
            return r is not None and r.status is not None

    def divert_late(self, store: ModelStore, rollout_id: str) -> Path | None:
        """Where a call for ``rollout_id`` is recorded instead of its rollout's file: apart,
        when the rollout API's rollout was finished already (None: its own file)."""
        if not self.is_finished(store, rollout_id):
            return None
        self._late_warned += 1
        if self._late_warned in (1, 10, 100, 1000):
            log.warning("a call for rollout %s arrived after the rollout was finished: recorded "
                        "apart (calls/%s), not trained on (%d such calls so far); fix: finish a "
                        "rollout only once every call it makes has returned", rollout_id,
                        LATE_CALLS, self._late_warned)
        return late_calls_path(store)

    def open(self, served: ServedModel, group: str | None, group_size: int | None,
             metadata: dict[str, Any]) -> ExternalRollout:
        rollout_id = "ext-" + uuid.uuid4().hex
        with self._logs.lock:
            state = self._logs.of(served.store)
            group = group or rollout_id
            members = [state.rollouts[i] for i in state.groups.get(group, [])]
            if members and members[0].group_size != group_size:
                raise invalid("group_size", f"must be the group's, {members[0].group_size}, for "
                              f"every rollout of group {group!r}")
            if members and (any(r.taken for r in members) or (
                    group_size is not None and len(members) >= group_size)):
                raise RolloutFinishedError(f"group {group!r} is complete (or handed out): "
                                           "open the rollout in a new group")
            state.write({"event": "open", "rollout_id": rollout_id, "group": group,
                         "group_size": group_size, "metadata": metadata, "at": time.time()})
            return state.rollouts[rollout_id]

    def update(self, rollout_id: str, event: dict[str, Any]) -> ExternalRollout:
        with self._logs.lock:
            state, r = self._find(rollout_id)
            if r.status is not None:
                raise RolloutFinishedError(f"rollout {rollout_id} was finished already "
                                           f"({r.status}, reward {r.reward}); its reward is "
                                           "final")
            state.write(event)
            return r

    def add_spans(self, rollout_id: str, spans: list[Span], model: str | None) -> int:
        store = self._store_for_spans(rollout_id, model)
        path = spans_path(store, rollout_id)
        with self._logs.lock:  # one line per post: a post is kept whole or not at all
            append_jsonl(path, {"spans": [span.model_dump(mode="json") for span in spans]})
        with self._spans_posted:
            self._spans_posted.notify_all()
        return len(spans)

    def spans_when_posted(self, store: ModelStore, rollout_id: str, calls: list[LLMCall],
                          deadline: float) -> list[Span]:
        """The spans posted for ``rollout_id``, once every span that ``calls`` announced is
        among them (a proxy posts a call's span after its answer) or ``deadline`` (monotonic)
        has passed; then the missing ones are named in a warning."""
        with self._spans_posted:
            while True:
                spans = read_spans(store, rollout_id)
                missing = awaited_span_ids(spans, calls)
                left = deadline - time.monotonic()
                if not missing:
                    return spans
                if left <= 0:
                    log.warning("rollout %s: %d span(s) its calls announced were not posted in "
                                "time (TRACERL_SPAN_WAIT_S), so its trajectory goes without "
                                "them: %s", rollout_id, len(missing), ", ".join(sorted(missing)))
                    return spans
                self._spans_posted.wait(left)

    def _store_for_spans(self, rollout_id: str, model: str | None) -> ModelStore:
        """The model whose rollout this is: the rollout API's, else the one with calls recorded
        under the id, else the one named ``model``."""
        try:
            with self._logs.lock:
                return self._find(rollout_id)[0].store
        except RolloutNotFoundError:
            pass
        for served in self.models.values():
            if served.store.calls_path(rollout_id).exists():
                return served.store
        if model is not None:
            return self.models.route(model)[0].store
        raise RolloutNotFoundError(f"no rollout {rollout_id} is known on this gateway: no call "
                                   "was recorded under it; name its model "
                                   "({\"model\": ..., \"spans\": [...]})")

    def take(self, store: ModelStore, n_groups: int, request_id: str
             ) -> list[list[ExternalRollout]]:
        """``n_groups`` ready groups, marked handed out (one fsynced event), or none while
        fewer are ready. A ``request_id`` seen before gets the same groups again."""
        validate_name("request id", request_id)
        if isinstance(n_groups, bool) or not isinstance(n_groups, int) or n_groups < 1:
            raise invalid("n_groups", f"must be an integer >= 1, got {n_groups!r}")
        with self._logs.lock:
            state = self._logs.of(store)
            ids = state.take(request_id, lambda: state.ready_groups()[:n_groups], n_groups)
            return [[state.rollouts[i] for i in group] for group in ids]

    def counts(self, store: ModelStore) -> dict[str, int]:
        with self._logs.lock:
            return self._logs.of(store).counts()

    def expire_open(self, store: ModelStore, older_than: float) -> list[str]:
        """Finish, as failed, the rollouts of ``store`` still open that were opened before
        ``older_than`` (online mode's expiry: their reward never came; a later one is a 409)."""
        with self._logs.lock:
            state = self._logs.of(store)
            doomed = [r for r in state.rollouts.values()
                      if r.status is None and r.created_at < older_than]
            for r in doomed:
                state.write({"event": "finish", "rollout_id": r.rollout_id, "at": time.time(),
                             "metrics": {}, "status": "failed",
                             "error": "expired: no reward within TRACERL_ONLINE_REWARD_TTL_S"})
            return [r.rollout_id for r in doomed]

    def install(self, app: FastAPI, answer_error: Callable[[TracerlError], JSONResponse]
                ) -> None:
        """Serve the routes (:data:`router`) on the gateway's ``app``, whose auth middleware
        guards them; errors are answered by ``answer_error`` (the gateway's OpenAI-shaped
        answer)."""
        app.state.rollout_api, app.state.rollout_api_errors = self, answer_error
        app.include_router(router)


def build_groups(rollouts: list[list[ExternalRollout]], store: ModelStore,
                 calls: CallStore, api: ExternalRollouts) -> list[TrajectoryGroup]:
    """Trajectory groups of handed-out rollouts: their recorded calls, posted spans (linked to
    the calls; the spans the calls announced are waited for, until ``TRACERL_SPAN_WAIT_S``),
    rewards and metrics; a failed rollout is its group's exception."""
    deadline = time.monotonic() + settings.TRACERL_SPAN_WAIT_S.get()
    groups = []
    for members in rollouts:
        trajectories, exceptions = [], []
        for r in members:
            if r.status == "failed":
                exceptions.append(RolloutException(
                    type="ExternalRolloutFailed", message=r.error or "failed (no error given)",
                    traceback="", rollout_id=r.rollout_id))
                continue
            recorded = calls.take(store, r.rollout_id)
            t = Trajectory(rollout_id=r.rollout_id, reward=r.reward or 0.0, metrics=r.metrics,
                           metadata={**r.metadata, "external": True}, llm_calls=recorded,
                           spans=api.spans_when_posted(store, r.rollout_id, recorded, deadline),
                           start_time=r.created_at, end_time=r.finished_at)
            link_spans_to_calls(t.spans, t.llm_calls)
            fill_messages_from_calls(t)
            trajectories.append(t)
        groups.append(TrajectoryGroup(trajectories, exceptions=exceptions,
                                      metadata={"group": members[0].group}))
    return groups


# --- routes ----------------------------------------------------------------------------------

router = APIRouter()
# a route's work: (the rollout API, the request, the path's rollout id, the parsed body) -> JSON
Handler = Callable[[ExternalRollouts, Request, Any, Any], Awaitable[Any]]


async def _answered(request: Request, rollout_id: str | None, handle: Handler, *,
                    any_body: bool = False) -> Any:
    """``handle``'s answer to ``request``, its body parsed (a JSON object unless ``any_body``);
    a refusal is the gateway's error answer."""
    api: ExternalRollouts = request.app.state.rollout_api
    answer_error: Callable[[TracerlError], JSONResponse] = request.app.state.rollout_api_errors
    try:
        body = await _body(request) if request.method == "POST" else None
        if request.method == "POST" and not any_body and not isinstance(body, dict):
            raise invalid("body", "must be a JSON object")
        return await handle(api, request, rollout_id, body)
    except ConfigError as e:  # a bad id or name
        return answer_error(invalid("rollout_id" if rollout_id else "group", str(e)))
    except TracerlError as e:
        return answer_error(e)


async def _body(request: Request) -> Any:
    raw = await read_limited_body(request, MAX_BODY_BYTES)
    if raw.lstrip()[:1] == b"[":  # a bare list of spans
        return parse_json_object(b'{"spans": ' + raw + b"}")["spans"]
    return parse_json_object(raw or b"{}")


@router.post("/v1/rollouts")
async def open_rollout(request: Request) -> Any:
    return await _answered(request, None, _open)


@router.get("/v1/rollouts/{rollout_id}")
async def get_rollout(request: Request, rollout_id: str) -> Any:
    return await _answered(request, rollout_id, _view)


@router.post("/v1/rollouts/{rollout_id}/spans")
async def post_spans(request: Request, rollout_id: str) -> Any:
    return await _answered(request, rollout_id, _spans, any_body=True)


@router.post("/v1/rollouts/{rollout_id}/reward")
async def post_reward(request: Request, rollout_id: str) -> Any:
    return await _answered(request, rollout_id, _reward)


@router.post("/v1/rollouts/{rollout_id}/finish")
async def post_finish(request: Request, rollout_id: str) -> Any:
    return await _answered(request, rollout_id, _finish)


async def _open(api: ExternalRollouts, request: Request, _: Any, body: dict[str, Any]) -> Any:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model", "must be the served model's name")
    group = body.get("group")
    if group is not None:
        try:
            validate_name("group", group)
        except ConfigError as e:
            raise invalid("group", str(e)) from None
    size = body.get("group_size")
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        raise invalid("group_size", f"must be an integer >= 1, got {size!r}")
    metadata = body.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise invalid("metadata", "must be a JSON object")
    try:
        served = api.models.route(model)[0]
    except TracerlError as e:
        raise invalid("model", str(e)) from None
    r = await asyncio.to_thread(api.open, served, group, size, metadata)
    base = str(request.base_url).rstrip("/")
    return {**r.view(), "model": model, "base_url": f"{base}/rollouts/{r.rollout_id}/v1",
            "headers": {"x-rollout-id": r.rollout_id}}


async def _view(api: ExternalRollouts, request: Request, rollout_id: str, _: Any) -> Any:
    return api.view(rollout_id)


async def _reward(api: ExternalRollouts, request: Request, rollout_id: str,
                  body: dict[str, Any]) -> Any:
    event = _reward_event("reward", rollout_id, body)
    return (await asyncio.to_thread(api.update, rollout_id, event)).view()


async def _finish(api: ExternalRollouts, request: Request, rollout_id: str,
                  body: dict[str, Any]) -> Any:
    event = _reward_event("finish", rollout_id, body)
    return (await asyncio.to_thread(api.update, rollout_id, event)).view()


async def _spans(api: ExternalRollouts, request: Request, rollout_id: str, body: Any) -> Any:
    model = None
    if isinstance(body, dict):
        model = body.get("model")
        body = body.get("spans")
    if not isinstance(body, list) or len(body) > MAX_SPANS_PER_POST:
        raise invalid("spans", f"must be a list of at most {MAX_SPANS_PER_POST} span objects")
    spans = []
    for i, item in enumerate(body):
        try:
            spans.append(Span.model_validate(item))
        except ValueError as e:
            raise invalid(f"spans[{i}]", f"is not a span: {e}") from None
    validate_name("rollout id", rollout_id)
    added = await asyncio.to_thread(api.add_spans, rollout_id, spans, model)
    return {"rollout_id": rollout_id, "added": added}


def _reward_event(kind: str, rollout_id: str, body: dict[str, Any]) -> dict[str, Any]:
    """A reward or finish event from a request body, validated (nothing written yet)."""
    event: dict[str, Any] = {"event": kind, "rollout_id": rollout_id, "at": time.time(),
                             "metrics": metrics_of(body.get("metrics"))}
    if kind == "reward" or body.get("reward") is not None:
        event["reward"] = reward_number(body.get("reward"))
    if kind == "finish":
        status = body.get("status", "ok")
        if status not in STATUSES:
            raise invalid("status", f"must be one of {list(STATUSES)}, got {status!r}")
        error = body.get("error")
        if error is not None and not isinstance(error, str):
            raise invalid("error", f"must be a string, got {error!r}")
        event["status"], event["error"] = status, error
    return event
