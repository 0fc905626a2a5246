"""``RemoteBackend``: the thin client of a ``tracerl serve`` server (e.g. on a GPU machine).

Rollouts talk to the server's gateway directly (``model.openai_client()``); registration,
training, logging and checkpoints go through its control API. Nothing here needs torch or a
web framework. Reliability rules:

- every request has one overall deadline (``timeout_s``, headers and body together), so a server
  that trickles its answer a byte at a time is an error, never a hang; on a training stream each
  event line has that deadline;
- requests are retried with exponential backoff on connection errors, 502/503/504 and answers
  that are not the API's (an HTML page, garbled JSON) for up to ``retry_for_s``; only idempotent
  requests are retried, and training and logging are made idempotent by a request id, so a
  retried ``train`` never trains a step twice; a server that keeps dropping the stream, or keeps
  forgetting the model, is retried with the same backoff, never in a tight loop;
- errors name the server and what it answered (:class:`BadAnswerError` for a redirect, an HTML
  page, empty or garbled JSON);
- a training request streams heartbeats; when the stream breaks (server killed, network gone)
  the client sends the same request id again and follows the step to its end, including a step
  the restarted server trains again from the trajectories it saved before the crash;
- a server that was restarted and lost a registration gets it again, transparently.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import random
import time
import uuid
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import httpx2

from ..core import settings
from ..core.backend import Backend, InferenceEndpoint, TrainEvent
from ..core.config import TrainConfig
from ..core.errors import (
    BackendUnavailableError,
    BadAnswerError,
    NotRegisteredError,
    TrainingError,
    exception_for,
)
from ..core.loops import PerLoop
from ..core.model_spec import ModelLike, spec_of
from ..core.net import is_loopback
from ..core.spans import Span
from ..core.trajectory import LLMCall, TrajectoryGroup, parse_group_lines
from ..events.hookspecs import hookimpl
from .wire import API_PREFIX, NDJSON, encode_groups

log = logging.getLogger(__name__)

T = TypeVar("T")
RETRY_STATUSES = {502, 503, 504}
MAX_REREGISTRATIONS = 3
# what a control-API answer is checked to be: a JSON object or array
JsonKind = type[dict[str, Any]] | type[list[Any]]


class _Retry(Exception):
    """A failure worth retrying (connection lost, server restarting)."""


class _BadAnswer(_Retry):
    """An answer that is not the API's (retried: a proxy in front of a restarting server)."""


def describe_answer(response: httpx2.Response, text: str | None = None) -> str:
    """What a server sent, in a few words: status, kind of body and its start."""
    body = response.text if text is None else text
    kind = response.headers.get("content-type", "no content type").split(";")[0]
    if not body.strip():
        return f"HTTP {response.status_code} with an empty body ({kind})"
    if "<html" in body[:1000].lower() or kind == "text/html":
        title = body.lower().find("<title>")
        head = body[title + 7: title + 87].split("<")[0] if title >= 0 else body[:80]
        return f"HTTP {response.status_code} with an HTML page ({head.strip()!r})"
    return f"HTTP {response.status_code} with {kind} {body[:200]!r}"


class _Backoff:
    """Jittered exponential waits (0.25 s doubling to 10 s) within a budget of seconds."""

    def __init__(self, budget_s: float) -> None:
        self.budget_s = budget_s
        self.reset()

    def reset(self) -> None:
        self.deadline, self.delay = time.monotonic() + self.budget_s, 0.25

    async def wait(self) -> bool:
        """Sleep before the next attempt; False, without sleeping, once the budget is spent."""
        if time.monotonic() + self.delay > self.deadline:
            return False
        await asyncio.sleep(self.delay * (0.5 + random.random()))
        self.delay = min(self.delay * 2, 10.0)
        return True


class RemoteBackend(Backend):
    """Serve and train models on a remote ``tracerl serve`` server.

    ``api_key`` defaults to the ``TRACERL_API_KEY`` environment variable.
    """

    name = "remote"

    def __init__(self, base_url: str, api_key: str | None = None, *, timeout_s: float = 60.0,
                 connect_timeout_s: float = 10.0, retry_for_s: float = 300.0,
                 compress_uploads: bool = True) -> None:
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        url = httpx2.URL(self.base_url)
        if url.scheme == "http" and not is_loopback(url.host):
            warnings.warn(
                f"{self.base_url} is plain HTTP: the API key and the trajectories cross the "
                "network unencrypted; put the server behind TLS (https://)",
                stacklevel=2,
            )
        self.api_key = api_key if api_key is not None else settings.TRACERL_API_KEY.get()
        self.timeout = httpx2.Timeout(timeout_s, connect=connect_timeout_s)
        self.timeout_s = timeout_s
        self.retry_for_s = retry_for_s
        self.compress_uploads = compress_uploads
        self._clients: PerLoop[httpx2.AsyncClient] = PerLoop(
            usable=lambda client: not client.is_closed)
        self._models: dict[str, Any] = {}

    def __repr__(self) -> str:
        return f"RemoteBackend({self.base_url!r})"

    # --- transport -------------------------------------------------------------------------

    def _client(self) -> httpx2.AsyncClient:
        def make(loop: asyncio.AbstractEventLoop) -> httpx2.AsyncClient:
            headers = {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            return httpx2.AsyncClient(base_url=self.base_url, headers=headers,
                                      timeout=self.timeout)

        return self._clients.get(make)

    async def _with_retries(self, what: str, attempt: Callable[[], Awaitable[T]]) -> T:
        """Run ``attempt`` until it succeeds, fails for good, or ``retry_for_s`` has passed."""
        backoff = _Backoff(self.retry_for_s)
        while True:
            try:
                async with asyncio.timeout(self.timeout_s):  # the whole attempt, not each read
                    return await attempt()
            except (_Retry, httpx2.TransportError, TimeoutError) as e:
                last = self._problem(e)
                bad_answer = isinstance(e, _BadAnswer)
            if not await backoff.wait():
                if bad_answer:
                    raise BadAnswerError(f"{what}: the server at {self.base_url} answered "
                                         f"{last} (retried for {self.retry_for_s:.0f} s)")
                raise BackendUnavailableError(
                    f"{what}: the server at {self.base_url} did not answer for "
                    f"{self.retry_for_s:.0f} s "
                    f"(last problem: {last})"
                )

    def _problem(self, e: BaseException) -> str:
        if isinstance(e, _BadAnswer):
            return str(e)
        if isinstance(e, TimeoutError):
            return f"no complete answer within the {self.timeout_s:g} s deadline"
        return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__

    async def _check(self, response: httpx2.Response) -> httpx2.Response:
        if response.status_code in RETRY_STATUSES:
            await response.aread()
            raise _Retry(describe_answer(response))
        if 300 <= response.status_code < 400:  # not followed: the key must not go elsewhere
            raise BadAnswerError(
                f"the server at {self.base_url} redirected {response.request.method} "
                f"{response.request.url.path} to {response.headers.get('location')!r} "
                f"(HTTP {response.status_code}); set the backend's base_url to the server's "
                "address itself")
        if response.status_code >= 400:
            await response.aread()
            try:
                payload = response.json()
            except ValueError:
                payload = None
            if not isinstance(payload, dict) or not isinstance(payload.get("error"), dict):
                payload = {"error": {"message": f"the server at {self.base_url} answered "
                                                f"{describe_answer(response)}"}}
            raise exception_for(response.status_code, payload)
        return response

    def _answer(self, response: httpx2.Response, kind: JsonKind, keys: tuple[str, ...]) -> Any:
        """The JSON value of a successful answer, checked to be a ``kind`` with ``keys``."""
        try:
            value = response.json()
        except ValueError:
            value = None
        if not isinstance(value, kind) or (keys and not all(k in value for k in keys)):
            want = f"a JSON {kind.__name__}" + (f" with {', '.join(keys)}" if keys else "")
            raise _BadAnswer(f"{describe_answer(response)} instead of {want}")
        return value

    async def _call(
        self,
        method: str,
        path: str,
        *,
        model: ModelLike | None = None,
        json_body: Any = None,
        content: bytes | None = None,
        headers: dict[str, str] | None = None,
        answer: JsonKind | None = dict,
        keys: tuple[str, ...] = (),
    ) -> Any:
        """An idempotent request, retried; re-registers ``model`` if the server forgot it.
        Returns the answer's JSON value (checked to be an ``answer`` with ``keys``), or the
        response itself when ``answer`` is None."""
        async def attempt() -> Any:
            response = await self._client().request(method, API_PREFIX + path, json=json_body,
                                                    content=content, headers=headers)
            await self._check(response)
            return response if answer is None else self._answer(response, answer, keys)

        try:
            return await self._with_retries(f"{method} {path}", attempt)
        except NotRegisteredError:
            if model is None or spec_of(model).key not in self._models:
                raise
            await self.register(model)  # once: a server that forgets again is an error
            return await self._with_retries(f"{method} {path}", attempt)

    def _model_path(self, model: ModelLike) -> str:
        spec = spec_of(model)
        return f"/models/{spec.project}/{spec.name}"

    def _upload(
        self, params: dict[str, Any], groups: list[TrajectoryGroup]
    ) -> tuple[bytes, dict[str, str]]:
        body = encode_groups(params, groups)
        headers = {"content-type": NDJSON}
        if self.compress_uploads:
            body = gzip.compress(body, compresslevel=1)
            headers["content-encoding"] = "gzip"
        return body, headers

    # --- Backend API -----------------------------------------------------------------------

    async def register(self, model: ModelLike) -> InferenceEndpoint:
        model = spec_of(model)
        info = await self._call("POST", "/models", json_body=model.definition(),
                                keys=("gateway_path", "model_name"))
        self._models[model.key] = model
        return InferenceEndpoint(
            self.base_url + info["gateway_path"],
            self.api_key or "tracerl-remote",
            info["model_name"],
        )

    async def status(self) -> dict[str, Any]:
        """The server's state: ready, models and their steps, training requests in progress."""
        return await self._call("GET", "/status")

    async def get_step(self, model: ModelLike) -> int:
        return (await self._call("GET", self._model_path(model), model=model,
                                 keys=("step",)))["step"]

    async def check_rows(self, model: ModelLike, groups: list[TrajectoryGroup]) -> None:
        """The server's checks of ``groups`` against ``model`` (its ``/check`` route: a 400
        naming the row raises :class:`InvalidTrajectoryError`); nothing is queued."""
        body, headers = self._upload({}, groups)
        await self._call("POST", self._model_path(model) + "/check", model=model,
                         content=body, headers=headers)

    async def train_events(self, model: ModelLike, groups: list[TrajectoryGroup],
                           config: TrainConfig) -> AsyncIterator[TrainEvent]:
        request_id = "train-" + uuid.uuid4().hex
        body, headers = self._upload(
            {"request_id": request_id, "config": config.model_dump(mode="json")}, groups
        )
        path = API_PREFIX + self._model_path(model) + "/train"
        backoff, started, registrations = _Backoff(self.retry_for_s), False, 0
        while True:
            alive = False  # this connection showed a step in progress (a heartbeat)
            try:
                async with asyncio.timeout(self.timeout_s) as deadline:  # per event line
                    async with self._client().stream(
                        "POST", path, content=body, headers=headers
                    ) as response:
                        await self._check(response)
                        async for line in response.aiter_lines():
                            deadline.reschedule(asyncio.get_running_loop().time() + self.timeout_s)
                            if not line.strip():
                                continue
                            event = self._train_event(response, line)
                            kind = event.get("event")
                            if kind == "started" and not started:
                                started = True
                                yield TrainEvent("started", event["step"])
                            elif kind == "heartbeat":
                                alive = True
                                yield TrainEvent("heartbeat", event.get("step") or 0,
                                                 elapsed_s=float(event.get("elapsed_s", 0.0)))
                            elif kind == "error":
                                raise exception_for(500, {"error": event})
                            elif kind == "done":
                                yield TrainEvent("done", event["step"], metrics=event["metrics"])
                                return
                        raise _Retry("the progress stream ended before the step did")
            except (_Retry, httpx2.TransportError, TimeoutError) as e:
                problem = self._problem(e)
                if alive:  # the step was running there: give the server the budget again
                    backoff.reset()
            except NotRegisteredError as e:  # the server restarted without this model
                registrations += 1
                if registrations > MAX_REREGISTRATIONS:
                    raise NotRegisteredError(
                        f"training request {request_id}: the server at {self.base_url} forgot "
                        f"model {spec_of(model).key} again after {MAX_REREGISTRATIONS} "
                        f"registrations ({e})") from e
                problem = f"model not registered ({e})"
                await self.register(model)
            if not await backoff.wait():
                raise TrainingError(
                    f"training request {request_id} lost the server at {self.base_url} for "
                    f"{self.retry_for_s:.0f} s (last problem: {problem}); the server keeps the "
                    "step's trajectories: `await backend.pending_groups(model)`")

    def _train_event(self, response: httpx2.Response, line: str) -> dict[str, Any]:
        try:
            event = json.loads(line)
        except ValueError:
            event = None
        if not isinstance(event, dict):
            raise _BadAnswer(f"a training stream line that is not a JSON event "
                             f"({describe_answer(response, line)})")
        if event.get("event") == "done" and not isinstance(event.get("metrics"), dict):
            raise _BadAnswer(f"a done event without metrics ({line[:200]!r})")
        return event

    async def log(self, model: ModelLike, groups: list[TrajectoryGroup], split: str, step: int,
                  metrics: dict[str, float]) -> None:
        params = {"request_id": "log-" + uuid.uuid4().hex, "split": split, "step": step,
                  "metrics": metrics}
        body, headers = self._upload(params, groups)
        await self._call("POST", self._model_path(model) + "/log", model=model, content=body,
                         headers=headers, keys=("logged",))

    async def fetch_calls(self, model: ModelLike, rollout_id: str) -> list[LLMCall]:
        found = await self._call(
            "GET", f"{self._model_path(model)}/calls/{rollout_id}", model=model, answer=list
        )
        return [LLMCall.model_validate(c) for c in found]

    async def fetch_spans(self, model: ModelLike, rollout_id: str) -> list[Span]:
        found = await self._call(
            "GET", f"{self._model_path(model)}/spans/{rollout_id}", model=model, answer=list
        )
        return [Span.model_validate(s) for s in found]

    async def take_external_groups(self, model: ModelLike, n_groups: int, request_id: str
                                   ) -> list[TrajectoryGroup]:
        """Retried safely: the server hands the same groups to the same ``request_id``."""
        response = await self._call(
            "POST", self._model_path(model) + "/external/take", model=model, answer=None,
            json_body={"n_groups": n_groups, "request_id": request_id})
        return parse_group_lines(response.text.splitlines(), "external groups")

    async def external_rollouts_status(self, model: ModelLike) -> dict[str, int]:
        return await self._call("GET", self._model_path(model) + "/external/status",
                                model=model, keys=("open", "ready_groups"))

    async def history(self, model: ModelLike) -> list[dict[str, Any]]:
        return await self._call("GET", self._model_path(model) + "/history", model=model,
                                answer=list)

    async def pending_groups(self, model: ModelLike) -> list[TrajectoryGroup]:
        """Groups the server saved for a step whose training never finished."""
        response = await self._call("GET", self._model_path(model) + "/pending", model=model,
                                    answer=None)
        return parse_group_lines(response.text.splitlines(), "pending groups")

    async def delete_checkpoints(self, model: ModelLike, keep_steps: set[int]) -> list[int]:
        answer = await self._call("POST", self._model_path(model) + "/checkpoints/delete",
                                  model=model, json_body={"keep_steps": sorted(keep_steps)},
                                  keys=("deleted",))
        for step, why in (answer.get("kept") or {}).items():  # the server keeps them; says why
            log.warning("%s: checkpoint %s kept: %s", spec_of(model).key, step, why)
        return answer["deleted"]

    async def close(self) -> None:
        for client in self._clients.pop_all():
            try:
                await client.aclose()
            except RuntimeError:  # its loop is gone
                pass


@hookimpl
def tracerl_backends() -> list[type]:
    return [RemoteBackend]
