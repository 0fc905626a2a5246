"""The inference gateway: an OpenAI-compatible endpoint in front of the engines.

Rollouts are attributed by path (``/rollouts/{id}/v1/...``) or by the ``x-rollout-id`` header.
Every call is recorded token-exactly before the response is returned. Errors are OpenAI-shaped:
bad requests get 4xx, an engine that is down gets 503 (and is restarted), a request that runs
past its deadline gets 504: never a hang.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..core.context import MAX_TAGS_BYTES, ROLLOUT_HEADER, TAGS_HEADER
from ..core.engine import (
    CallRoute,
    Engine,
    EngineError,
    EngineRequestError,
    EngineTimeoutError,
    EngineUnavailableError,
    current_route,
)
from ..core.errors import (
    AuthenticationError,
    ConfigError,
    RequestError,
    TracerlError,
    error_type,
)
from ..core.lifecycle import llm_call_recorded
from ..core.storage import ModelStore, validate_name
from .recorder import (
    CallStore,
    StreamAssembler,
    build_call,
    inject_training_fields,
    strip_for_caller,
)
from .request_body import parse_json_object, read_limited_body

MAX_BODY_BYTES = 32 * 1024 * 1024
MAX_PINNED_ROLLOUTS = 65536  # rollouts whose policy version is remembered (oldest forgotten)


def openai_error(status: int, message: str, *, param: str | None = None,
                 code: str | None = None) -> JSONResponse:
    """An OpenAI-shaped error answer (the gateway's and the control API's)."""
    return JSONResponse(status_code=status, content={
        "error": {"message": message, "type": error_type(status), "param": param, "code": code}})


def error_response(e: TracerlError) -> JSONResponse:
    """The answer for one of tracerl's errors: its status and code from the error tree."""
    return openai_error(e.status, str(e), param=getattr(e, "param", None), code=e.code)


class _SwapLock:
    """Requests share it; an adapter swap waits for requests in flight and holds new ones."""

    def __init__(self) -> None:
        self._readers = 0
        self._cond = asyncio.Condition()
        self._swapping = False

    async def acquire_read(self) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._swapping)
            self._readers += 1

    async def release_read(self) -> None:
        async with self._cond:
            self._readers -= 1
            self._cond.notify_all()

    async def __aenter__(self) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._swapping)
            self._swapping = True
            await self._cond.wait_for(lambda: self._readers == 0)

    async def __aexit__(self, *exc: object) -> None:
        async with self._cond:
            self._swapping = False
            self._cond.notify_all()


@dataclass(frozen=True)
class Attribution:
    """Who made a call: the rollout (path or header) and the caller's call tags."""

    rollout_id: str | None
    tags: dict[str, Any] | None = None


def parse_tags(header: str | None) -> dict[str, Any] | None:
    """The ``x-tracerl-tags`` header: a small JSON object of scalar values."""
    if header is None:
        return None
    if len(header.encode()) > MAX_TAGS_BYTES:
        raise EngineRequestError(
            f"{TAGS_HEADER} is larger than {MAX_TAGS_BYTES} bytes", param=TAGS_HEADER
        )
    try:
        tags = json.loads(header)
    except json.JSONDecodeError:
        raise EngineRequestError(
            f"{TAGS_HEADER} must be a JSON object", param=TAGS_HEADER
        ) from None
    if not isinstance(tags, dict) or not all(
        isinstance(k, str) and isinstance(v, str | int | float | bool | type(None))
        for k, v in tags.items()
    ):
        raise EngineRequestError(
            f"{TAGS_HEADER} must be a JSON object of scalar values", param=TAGS_HEADER
        )
    return tags


@dataclass
class ServedModel:
    """A trainable model's route: requests for ``name`` go to its newest adapter."""

    name: str
    engine: Engine
    store: ModelStore
    step: int = 0
    swap: _SwapLock = field(default_factory=_SwapLock)
    resident: int = 1  # policy versions kept loaded (EngineConfig.resident_adapters)
    versions: dict[int, Any] = field(default_factory=dict)  # resident step -> adapter path
    pins: OrderedDict[str, int] = field(default_factory=OrderedDict)  # rollout -> its version

    async def swap_adapter(self, step: int, path: Any) -> None:
        """Serve checkpoint ``step``. One resident version: swapped in place once calls in
        flight have finished (new calls wait). Several: ``step`` is loaded beside the others as
        ``name@step``; the oldest beyond ``resident`` is unloaded once no call uses it."""
        if self.resident <= 1:
            async with self.swap:
                await self.engine.load_adapter(self.name, path)
                self.step = step
            return
        await self.engine.load_adapter(self.lora_name(step), path)
        self.versions[step] = path
        self.step = max(self.step, step)
        retired = sorted(self.versions)[:-self.resident]
        if retired:
            async with self.swap:
                for old in retired:
                    del self.versions[old]
                    await self.engine.unload_adapter(self.lora_name(old))

    def still_served(self, step: int | None, body: dict[str, Any], rollout_id: str | None,
                     engine_body: dict[str, Any]) -> int | None:
        """After waiting for a swap: if it retired the version this call was resolved to,
        resolve again (``engine_body`` gets the new engine model name); the step to record."""
        if step is None or self.resident <= 1 or self._resident(step) or "@" in body["model"]:
            return step  # (an explicit NAME@STEP that was retired gets the engine's 404)
        engine_body["model"], step = self.resolve(body["model"], rollout_id)
        return step

    def lora_name(self, step: int) -> str:
        return self.name if self.resident <= 1 else f"{self.name}@{step}"

    def _resident(self, step: int) -> bool:
        if step == 0:
            return self.step < self.resident  # the base model counts as version 0
        return step == self.step if self.resident <= 1 else step in self.versions

    def resolve(self, requested: str, rollout_id: str | None = None) -> tuple[str, int | None]:
        """Engine model name and adapter step for a requested model name. With several
        resident versions, a rollout stays on the version its first call got while that
        version is resident (the call records which one served it)."""
        if requested == self.engine.spec.served_name and requested != self.name:
            return requested, None
        step = self.step
        if "@" in requested:
            _, _, raw = requested.partition("@")
            if not raw.isdigit():
                raise EngineRequestError(f"bad step in model name {requested!r}", status=404,
                                         param="model", code="model_not_found")
            if not self._resident(int(raw)):
                served = sorted(self.versions) if self.resident > 1 else [self.step]
                raise EngineRequestError(
                    f"The model `{requested}` is not served: step {raw} is not the current step "
                    f"({self.step}) nor resident (steps served: {served}); use `{self.name}` or "
                    f"`{self.name}@{self.step}`",
                    status=404, param="model", code="model_not_found")
            step = int(raw)
        elif self.resident > 1 and rollout_id is not None:
            pinned = self.pins.get(rollout_id)
            if pinned is not None and self._resident(pinned):
                step = pinned
            else:
                self.pins[rollout_id] = step
                while len(self.pins) > MAX_PINNED_ROLLOUTS:
                    self.pins.popitem(last=False)
        if step == 0:
            return self.engine.spec.served_name, 0
        return self.lora_name(step), step


class Gateway:
    """The gateway's state: routes, records and engine supervision."""

    def __init__(self, api_key: str | None = None, restart_grace_s: float = 30.0) -> None:
        self.api_key = api_key
        self.restart_grace_s = restart_grace_s
        self.models: dict[str, ServedModel] = {}
        self.calls = CallStore()
        self._restarts: dict[int, asyncio.Task] = {}
        self.app = self._build_app()

    # --- routing ---------------------------------------------------------------------------

    def add_model(self, served: ServedModel) -> None:
        self.models[served.name] = served

    def _route(self, requested: Any, rollout_id: str | None = None
               ) -> tuple[ServedModel, str, int | None]:
        if not isinstance(requested, str) or not requested:
            raise EngineRequestError("you must provide a model parameter", param="model")
        name = requested.partition("@")[0]
        served = self.models.get(name)
        if served is None:
            for m in self.models.values():
                if m.engine.spec.served_name == requested:
                    served = m
                    break
        if served is None:
            known = sorted(
                {*self.models, *(m.engine.spec.served_name for m in self.models.values())}
            )
            raise EngineRequestError(f"The model `{requested}` does not exist. Served: {known}",
                                     status=404, param="model", code="model_not_found")
        engine_model, step = served.resolve(requested, rollout_id)
        return served, engine_model, step

    def _schedule_restart(self, engine: Engine) -> None:
        task = self._restarts.get(id(engine))
        if task is not None and not task.done():
            return

        async def restart() -> None:
            # A busy or briefly stalled engine is not a dead one: restarting a working vLLM costs
            # a cold start (~100 s on a GPU) and fails every call in flight. Restart at once only
            # if its process is gone; otherwise only after restart_grace_s of failed checks.
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.restart_grace_s
            while not await engine.healthy():
                if not engine.alive() or loop.time() >= deadline:
                    await engine.restart()
                    return
                await asyncio.sleep(1.0)

        self._restarts[id(engine)] = asyncio.create_task(restart())

    # --- app -------------------------------------------------------------------------------

    def check_auth(self, request: Request) -> JSONResponse | None:
        if self.api_key is None:
            return None
        auth = request.headers.get("authorization", "")
        token = auth[7:] if auth.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(token.encode(), self.api_key.encode()):
            return error_response(AuthenticationError(
                "Incorrect or missing API key (send Authorization: Bearer <key>)"))
        return None

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="tracerl gateway", docs_url=None, redoc_url=None)

        @app.get("/health")
        async def health() -> dict[str, Any]:  # no key needed, so it tells nothing about models
            return {"status": "ok"}

        async def list_models(request: Request) -> Any:
            if (denied := self.check_auth(request)) is not None:
                return denied
            data = []
            for m in self.models.values():
                for mid in (m.name, f"{m.name}@{m.step}", m.engine.spec.served_name):
                    data.append({"id": mid, "object": "model", "created": 0, "owned_by": "tracerl"})
            return {"object": "list", "data": data}

        async def chat(request: Request, rollout_id: str | None = None) -> Any:
            return await self._handle(request, "chat.completions", rollout_id)

        async def completions(request: Request, rollout_id: str | None = None) -> Any:
            return await self._handle(request, "completions", rollout_id)

        for prefix in ("", "/rollouts/{rollout_id}"):
            app.add_api_route(prefix + "/v1/models", list_models, methods=["GET"])
            app.add_api_route(prefix + "/v1/chat/completions", chat, methods=["POST"])
            app.add_api_route(prefix + "/v1/completions", completions, methods=["POST"])
        return app

    async def _read_body(self, request: Request) -> dict[str, Any]:
        return parse_json_object(await read_limited_body(request, MAX_BODY_BYTES))

    @staticmethod
    def _check_body(endpoint: str, body: dict[str, Any]) -> None:
        if endpoint == "chat.completions":
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs:
                raise EngineRequestError("messages must be a non-empty list", param="messages")
            for i, m in enumerate(msgs):
                if not isinstance(m, dict) or "role" not in m:
                    raise EngineRequestError(f"messages[{i}] must be an object with a role",
                                             param=f"messages[{i}]")
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
                raise EngineRequestError("send one prompt per request (a string or token ids) so "
                                         "the call can be recorded exactly", param="prompt")

    async def _handle(self, request: Request, endpoint: str, path_rollout: str | None) -> Any:
        if (denied := self.check_auth(request)) is not None:
            return denied
        try:
            body = await self._read_body(request)
            rollout_id = path_rollout or request.headers.get(ROLLOUT_HEADER)
            if rollout_id is not None:
                validate_name("rollout id", rollout_id)
            who = Attribution(rollout_id, parse_tags(request.headers.get(TAGS_HEADER)))
            self._check_body(endpoint, body)
            served, engine_model, step = self._route(body.get("model"), rollout_id)
        except (EngineRequestError, RequestError) as e:
            return error_response(e)
        except ConfigError as e:  # the rollout id
            return openai_error(e.status, str(e), param="rollout_id", code=e.code)

        engine_body = inject_training_fields(endpoint, {**body, "model": engine_model})
        route = CallRoute(who.rollout_id)  # a replica set keeps the rollout on one server
        current_route.set(route)
        timeout = served.engine.spec.config.request_timeout_s
        if body.get("stream"):
            if endpoint != "chat.completions":
                return error_response(EngineRequestError(
                    "streaming is supported for chat completions only", param="stream"))
            return await self._stream(served, engine_body, body, who, step, timeout, route)

        await served.swap.acquire_read()
        step = served.still_served(step, body, who.rollout_id, engine_body)
        started = time.perf_counter()
        try:
            call = (
                served.engine.chat if endpoint == "chat.completions" else served.engine.completions
            )
            response = await asyncio.wait_for(call(engine_body), timeout)
        except EngineRequestError as e:
            return error_response(e)
        except TimeoutError:  # the gateway's deadline, or the engine's transport
            self._schedule_restart(served.engine)
            return error_response(EngineTimeoutError(
                f"the engine did not answer within {timeout} s"))
        except EngineError as e:
            self._schedule_restart(served.engine)
            return error_response(EngineUnavailableError(
                f"the inference engine is unavailable and is being restarted: {e}"))
        finally:
            await served.swap.release_read()
        response["model"] = body["model"]
        await self._record(served, endpoint, body, response, who, step,
                           time.perf_counter() - started, streamed=False, route=route)
        return JSONResponse(strip_for_caller(endpoint, body, response))

    async def _record(self, served: ServedModel, endpoint: str, body: dict[str, Any],
                      response: dict[str, Any] | None, who: Attribution, step: int | None,
                      latency: float, streamed: bool, error: str | None = None,
                      route: CallRoute | None = None) -> None:
        call = build_call(
            endpoint=endpoint,
            caller_body=body,
            response=response,
            rollout_id=who.rollout_id,
            model=body.get("model", ""),
            adapter_step=step,
            latency_s=latency,
            streamed=streamed,
            error=error,
        )
        if who.tags:
            call.metadata["tags"] = who.tags
        if route is not None and route.replica is not None:
            call.metadata["replica"] = route.replica
        # Serialising and fsyncing a record takes milliseconds: done in a worker thread, so that
        # hundreds of concurrent calls do not queue behind each other's disk writes. The caller
        # gets its answer only once the record is on disk; the write and the plugin hook happen
        # even if this request is cancelled meanwhile (a client that went away).
        written = asyncio.ensure_future(asyncio.to_thread(self.calls.add, served.store, call))

        def notify(done: asyncio.Future) -> None:
            if not done.cancelled() and done.exception() is None:
                llm_call_recorded(call)

        written.add_done_callback(notify)
        await asyncio.shield(written)

    async def _stream(self, served: ServedModel, engine_body: dict[str, Any], body: dict[str, Any],
                      who: Attribution, step: int | None, timeout: float,
                      route: CallRoute | None = None) -> Any:
        """Forward SSE chunks as they come while assembling the record."""
        await served.swap.acquire_read()
        step = served.still_served(step, body, who.rollout_id, engine_body)
        started = time.perf_counter()
        stream = served.engine.chat_stream(engine_body)
        try:  # the first chunk is awaited here so that engine errors become proper statuses
            first = await asyncio.wait_for(anext(stream), timeout)
        except StopAsyncIteration:
            first = None
        except EngineRequestError as e:
            await served.swap.release_read()
            return error_response(e)
        except (EngineError, TimeoutError) as e:
            await served.swap.release_read()
            self._schedule_restart(served.engine)
            return error_response(EngineUnavailableError(
                f"the inference engine is unavailable: {e}"))

        async def events() -> AsyncIterator[bytes]:
            assembler = StreamAssembler()
            error = None
            try:
                chunk = first
                while chunk is not None:
                    assembler.add(chunk)
                    chunk["model"] = body["model"]
                    yield (
                        b"data: "
                        + json.dumps(strip_for_caller("chat.completions", body, chunk)).encode()
                        + b"\n\n"
                    )
                    try:
                        chunk = await asyncio.wait_for(anext(stream), timeout)
                    except StopAsyncIteration:
                        chunk = None
                yield b"data: [DONE]\n\n"
            except (EngineError, TimeoutError) as e:
                error = f"stream broke off: {e or type(e).__name__}"
                self._schedule_restart(served.engine)
                payload = {
                    "error": {
                        "message": error,
                        "type": "service_unavailable",
                        "param": None,
                        "code": None,
                    }
                }
                yield b"data: " + json.dumps(payload).encode() + b"\n\n"
            finally:
                await served.swap.release_read()
                await self._record(served, "chat.completions", body, assembler.response(), who,
                                   step, time.perf_counter() - started, streamed=True, error=error,
                                   route=route)

        return StreamingResponse(events(), media_type="text/event-stream")
