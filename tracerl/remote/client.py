"""``RemoteBackend``: the thin client of a ``tracerl serve`` server (e.g. on a GPU machine).

Rollouts talk to the server's gateway directly (``model.openai_client()``); registration,
training, logging and checkpoints go through its control API. Nothing here needs torch or a
web framework. Reliability rules:

- every request has a deadline; a server that stops answering becomes an error, never a hang;
- requests are retried with exponential backoff on connection errors and 502/503/504 for up to
  ``retry_for_s``; only idempotent requests are retried, and training and logging are made
  idempotent by a request id, so a retried ``train`` never trains a step twice;
- a training request streams heartbeats; when the stream breaks (server killed, network gone)
  the client sends the same request id again and follows the step to its end, including a step
  the restarted server trains again from the trajectories it saved before the crash;
- a server that was restarted and lost a registration gets it again, transparently.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import random
import time
import uuid
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import httpx2

from ..core.backend import Backend, InferenceEndpoint, TrainEvent
from ..core.config import TrainConfig
from ..core.errors import (
    BackendUnavailableError,
    NotRegisteredError,
    TrainingError,
    exception_for,
)
from ..core.hookspecs import hookimpl
from ..core.loops import PerLoop
from ..core.model_spec import ModelLike, spec_of
from ..core.net import is_loopback
from ..core.trajectory import LLMCall, TrajectoryGroup, parse_group_lines
from .wire import API_PREFIX, NDJSON, encode_groups

T = TypeVar("T")
RETRY_STATUSES = {502, 503, 504}


class _Retry(Exception):
    """A failure worth retrying (connection lost, server restarting)."""


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
        self.api_key = api_key if api_key is not None else os.environ.get("TRACERL_API_KEY")
        self.timeout = httpx2.Timeout(timeout_s, connect=connect_timeout_s)
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
                return await attempt()
            except (_Retry, httpx2.TransportError) as e:
                last = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            if not await backoff.wait():
                raise BackendUnavailableError(
                    f"{what}: the server at {self.base_url} did not answer for "
                    f"{self.retry_for_s:.0f} s "
                    f"(last problem: {last})"
                )

    async def _check(self, response: httpx2.Response) -> httpx2.Response:
        if response.status_code in RETRY_STATUSES:
            await response.aread()
            raise _Retry(f"HTTP {response.status_code}: {response.text[:300]}")
        if response.status_code >= 400:
            await response.aread()
            try:
                payload = response.json()
            except ValueError:
                payload = response.text
            raise exception_for(response.status_code, payload)
        return response

    async def _call(
        self,
        method: str,
        path: str,
        *,
        model: ModelLike | None = None,
        json_body: Any = None,
        content: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> Any:
        """An idempotent request, retried; re-registers ``model`` if the server forgot it."""
        async def attempt() -> Any:
            response = await self._client().request(method, API_PREFIX + path, json=json_body,
                                                    content=content, headers=headers)
            return await self._check(response)

        try:
            response = await self._with_retries(f"{method} {path}", attempt)
        except NotRegisteredError:
            if model is None or spec_of(model).key not in self._models:
                raise
            await self.register(model)
            response = await self._with_retries(f"{method} {path}", attempt)
        return response

    def _model_path(self, model: ModelLike) -> str:
        return f"/models/{model.project}/{model.name}"

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
        response = await self._call("POST", "/models", json_body=model.definition())
        self._models[model.key] = model
        info = response.json()
        return InferenceEndpoint(
            self.base_url + info["gateway_path"],
            self.api_key or "tracerl-remote",
            info["model_name"],
        )

    async def status(self) -> dict[str, Any]:
        """The server's state: ready, models and their steps, training requests in progress."""
        return (await self._call("GET", "/status")).json()

    async def get_step(self, model: ModelLike) -> int:
        return (await self._call("GET", self._model_path(model), model=model)).json()["step"]

    async def train_events(self, model: ModelLike, groups: list[TrajectoryGroup],
                           config: TrainConfig) -> AsyncIterator[TrainEvent]:
        request_id = "train-" + uuid.uuid4().hex
        body, headers = self._upload(
            {"request_id": request_id, "config": config.model_dump(mode="json")}, groups
        )
        path = API_PREFIX + self._model_path(model) + "/train"
        backoff, started = _Backoff(self.retry_for_s), False
        while True:
            connected = False
            try:
                async with self._client().stream(
                    "POST", path, content=body, headers=headers
                ) as response:
                    await self._check(response)
                    connected = True
                    async for line in response.aiter_lines():
                        if not line.strip():
                            continue
                        event = json.loads(line)
                        kind = event.get("event")
                        if kind == "started" and not started:
                            started = True
                            yield TrainEvent("started", event["step"])
                        elif kind == "heartbeat":
                            yield TrainEvent("heartbeat", event.get("step") or 0,
                                             elapsed_s=float(event.get("elapsed_s", 0.0)))
                        elif kind == "error":
                            raise exception_for(500, {"error": event})
                        elif kind == "done":
                            yield TrainEvent("done", event["step"], metrics=event["metrics"])
                            return
                    raise _Retry("the progress stream ended before the step did")
            except (_Retry, httpx2.TransportError) as e:
                problem = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
                if connected:  # the server was there: give it the whole budget to come back
                    backoff.reset()
            except NotRegisteredError:
                await self.register(model)  # the server restarted without this model
                continue
            if not await backoff.wait():
                raise TrainingError(
                    f"training request {request_id} lost the server at {self.base_url} for "
                    f"{self.retry_for_s:.0f} s (last problem: {problem}); the server keeps the "
                    "step's trajectories: `await backend.pending_groups(model)`")

    async def log(self, model: ModelLike, groups: list[TrajectoryGroup], split: str, step: int,
                  metrics: dict[str, float]) -> None:
        params = {"request_id": "log-" + uuid.uuid4().hex, "split": split, "step": step,
                  "metrics": metrics}
        body, headers = self._upload(params, groups)
        await self._call("POST", self._model_path(model) + "/log", model=model, content=body,
                         headers=headers)

    async def fetch_calls(self, model: ModelLike, rollout_id: str) -> list[LLMCall]:
        response = await self._call(
            "GET", f"{self._model_path(model)}/calls/{rollout_id}", model=model
        )
        return [LLMCall.model_validate(c) for c in response.json()]

    async def history(self, model: ModelLike) -> list[dict[str, Any]]:
        return (await self._call("GET", self._model_path(model) + "/history", model=model)).json()

    async def pending_groups(self, model: ModelLike) -> list[TrajectoryGroup]:
        """Groups the server saved for a step whose training never finished."""
        response = await self._call("GET", self._model_path(model) + "/pending", model=model)
        return parse_group_lines(response.text.splitlines(), "pending groups")

    async def delete_checkpoints(self, model: ModelLike, keep_steps: set[int]) -> list[int]:
        response = await self._call("POST", self._model_path(model) + "/checkpoints/delete",
                                    model=model, json_body={"keep_steps": sorted(keep_steps)})
        return response.json()["deleted"]

    async def close(self) -> None:
        for client in self._clients.pop_all():
            try:
                await client.aclose()
            except RuntimeError:  # its loop is gone
                pass


@hookimpl
def tracerl_backends() -> list[type]:
    return [RemoteBackend]
