"""The inference gateway: an OpenAI-compatible endpoint in front of the engines.

Rollouts are attributed by path (``/rollouts/{id}/v1/...``) or by the ``x-rollout-id`` header.
Every call is recorded token-exactly before the response is returned. Errors are OpenAI-shaped:
bad requests get 4xx, an engine that is down gets 503 (and is restarted), a request that runs
past its deadline gets 504: never a hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

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
from ..core.storage import ModelStore, validate_name
from ..core.trajectory import LLMCall
from ..core.watchdog import watch
from ..events.lifecycle import llm_call_recorded
from .external_rollouts import ExternalRollouts
from .protocols.anthropic_messages import AnthropicMessages
from .protocols.base import Exchange
from .protocols.responses import Responses
from .recorder import (
    CallStore,
    StreamAssembler,
    build_call,
    caller_wants_logprobs,
    drop_logprob_entries,
    inject_training_fields,
    strip_for_caller,
)
from .request_body import parse_json_object, read_limited_body
from .request_validation import check_request

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 32 * 1024 * 1024
PARSE_IN_THREAD_BYTES = 256 * 1024
MAX_CHARS_PER_TOKEN = 256  # a prompt longer than this many characters per token cannot fit
STREAM_CLOSE_TIMEOUT_S = 5.0
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
    """Requests share it; an adapter swap waits for requests in flight and holds new ones.

    Releasing a read is synchronous (no ``await``), so a cancelled request or a closed stream
    cannot leave its reader counted; every wait has a deadline and says what it waited for.
    """

    def __init__(self, model: str = "") -> None:
        self.model = model
        self._readers = 0
        self._idle = asyncio.Event()  # set while no request is in flight
        self._idle.set()
        self._open = asyncio.Event()  # set while no swap is running or waiting
        self._open.set()
        self._swapper = asyncio.Lock()

    @property
    def readers(self) -> int:
        return self._readers

    async def acquire_read(self, timeout_s: float) -> None:
        try:
            async with asyncio.timeout(timeout_s):
                while not self._open.is_set():
                    await self._open.wait()
        except TimeoutError:
            raise EngineTimeoutError(
                f"waited {timeout_s:g} s for the adapter swap of model {self.model} to finish"
            ) from None
        self._readers += 1
        self._idle.clear()

    def release_read(self) -> None:
        self._readers -= 1
        if self._readers <= 0:
            self._readers = 0
            self._idle.set()

    def describe(self) -> str:
        """Who holds the lock (the watchdog's view of a waiting swap)."""
        held = "a swap holds new requests; " if not self._open.is_set() else ""
        return f"{held}{self._readers} requests in flight hold the swap lock"

    @contextlib.asynccontextmanager
    async def swapping(self, timeout_s: float) -> AsyncIterator[None]:
        """Hold new requests, wait (at most ``timeout_s``) for those in flight, then swap."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._swapper.acquire()
        except TimeoutError:
            raise EngineTimeoutError(f"waited {timeout_s:g} s for another adapter swap of model "
                                     f"{self.model}") from None
        try:
            self._open.clear()
            try:
                async with asyncio.timeout(timeout_s):
                    await self._idle.wait()
            except TimeoutError:
                raise EngineTimeoutError(
                    f"waited {timeout_s:g} s for {self._readers} call(s) in flight on model "
                    f"{self.model} to finish before swapping its adapter") from None
            yield
        finally:
            self._open.set()
            self._swapper.release()


class KeyRequired:
    """ASGI middleware: answer a request that ``check`` refuses before any route runs.

    Plain ASGI rather than ``@app.middleware("http")``: Starlette's ``BaseHTTPMiddleware`` wraps
    every request and response in a task group and a memory stream, a per-call cost the gateway
    pays hundreds of times a second (``benchmarks/rollout_throughput.py`` with
    ``benchmarks/instant_vllm``).
    """

    def __init__(self, app: Any, *, check: Callable[[Request], JSONResponse | None],
                 exempt: tuple[str, ...] = (), only_under: str = "/") -> None:
        self.app, self.check, self.exempt, self.only_under = app, check, exempt, only_under

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if (scope["type"] == "http" and scope["path"] not in self.exempt
                and scope["path"].startswith(self.only_under)
                and (denied := self.check(Request(scope))) is not None):
            await denied(scope, receive, send)
            return
        await self.app(scope, receive, send)


@dataclass(frozen=True)
class Attribution:
    """Who made a call: the rollout (path or header) and the caller's call tags."""

    rollout_id: str | None
    tags: dict[str, Any] | None = None


def _keeps_logprob_entries(body: dict[str, Any], exchange: Exchange | None) -> bool:
    """Whether a chat call's reply keeps the engine's per-token logprob entries: when its caller
    asked for logprobs, or a protocol (Responses, Anthropic) renders the answer; otherwise only
    the sampled tokens' logprobs are kept (:func:`~.recorder.drop_logprob_entries`)."""
    return exchange is not None or caller_wants_logprobs("chat.completions", body)


async def _without_logprob_entries(reply: Awaitable[dict[str, Any]]) -> dict[str, Any]:
    """The engine's chat reply, its per-token logprob entries dropped in the same step as it is
    decoded (before other calls' replies are: at 256 replies ending together, all of them would
    otherwise be alive at once)."""
    return drop_logprob_entries(await reply)


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
    """A trainable model's route: requests for ``name`` (or ``project/name``, always unique) go
    to its newest adapter. Its identity is the (project, name) pair of its ``store``."""

    name: str
    engine: Engine
    store: ModelStore
    step: int = 0
    swap: _SwapLock = field(default_factory=_SwapLock)
    resident: int = 1  # policy versions kept loaded (EngineConfig.resident_adapters)
    versions: dict[int, Any] = field(default_factory=dict)  # resident step -> adapter path
    pins: OrderedDict[str, int] = field(default_factory=OrderedDict)  # rollout -> its version

    def __post_init__(self) -> None:
        self.swap.model = self.key

    @property
    def key(self) -> str:
        """``project/name``: the route's identity (two projects may share a model name)."""
        return f"{self.store.project}/{self.name}"

    @property
    def adapter_name(self) -> str:
        """The adapter's name in the engine: one per (project, name), never shared."""
        return self.key

    @property
    def timeout_s(self) -> float:
        return self.engine.spec.config.request_timeout_s

    async def swap_adapter(self, step: int, path: Any) -> None:
        """Serve checkpoint ``step``. One resident version: swapped in place once calls in
        flight have finished (new calls wait). Several: ``step`` is loaded beside the others as
        ``name@step``; the oldest beyond ``resident`` is unloaded once no call uses it."""
        with watch("swap", f"the adapter swap of {self.name} to step {step}",
                   self.swap.describe):
            if self.resident <= 1:
                async with self.swap.swapping(self.timeout_s + 30.0):
                    await self.engine.load_adapter(self.adapter_name, path)
                    self.step = step
                return
            await self.engine.load_adapter(self.lora_name(step), path)
            self.versions[step] = path
            self.step = max(self.step, step)
            retired = sorted(self.versions)[:-self.resident]
            if retired:
                async with self.swap.swapping(self.timeout_s + 30.0):
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
        return self.adapter_name if self.resident <= 1 else f"{self.adapter_name}@{step}"

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
        self.models: dict[str, ServedModel] = {}  # by project/name
        self.rollouts = ExternalRollouts(self)  # the rollout API for outside services
        self.calls = CallStore(divert=self.rollouts.divert_late)
        self.protocols = {"responses": Responses(), "anthropic.messages": AnthropicMessages()}
        self._restarts: dict[int, asyncio.Task] = {}
        self._streams: set[asyncio.Task] = set()  # stream pumps in flight (kept referenced)
        self.app = self._build_app()

    # --- routing ---------------------------------------------------------------------------

    def add_model(self, served: ServedModel) -> None:
        self.models[served.key] = served

    def model_id(self, served: ServedModel) -> str:
        """The model name callers use: ``name`` while no other project serves that name, else
        ``project/name``."""
        shared = any(m.name == served.name and m is not served for m in self.models.values())
        return served.key if shared else served.name

    def _route(self, requested: Any, rollout_id: str | None = None
               ) -> tuple[ServedModel, str, int | None]:
        if not isinstance(requested, str) or not requested:
            raise EngineRequestError("you must provide a model parameter", param="model")
        name = requested.partition("@")[0]
        served = self.models.get(name) if "/" in name else None
        if served is None and "/" not in name:
            named = [m for m in self.models.values() if m.name == name]
            if len(named) > 1:
                raise EngineRequestError(
                    f"The model `{requested}` is ambiguous: projects "
                    f"{sorted(m.store.project for m in named)} each have a model `{name}`; "
                    f"use one of {sorted(m.key for m in named)}",
                    status=404, param="model", code="model_not_found")
            served = named[0] if named else None
        if served is None:
            for m in self.models.values():
                if m.engine.spec.served_name == requested:
                    served = m
                    break
        if served is None:
            known = sorted(
                {*self.models, *(self.model_id(m) for m in self.models.values()),
                 *(m.engine.spec.served_name for m in self.models.values())}
            )
            raise EngineRequestError(f"The model `{requested}` does not exist. Served: {known}",
                                     status=404, param="model", code="model_not_found")
        engine_model, step = served.resolve(requested.rpartition("/")[2]
                                            if "/" in name else requested, rollout_id)
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

        # before any route reads the body; the schema and unknown routes are covered too
        app.add_middleware(KeyRequired, check=self.check_auth, exempt=("/health",))

        @app.exception_handler(StarletteHTTPException)
        async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
            if e.status_code == 404:
                return openai_error(404, f"Unknown route: {request.method} {request.url.path}",
                                    code="not_found")
            return openai_error(e.status_code, str(e.detail), code=f"http_{e.status_code}")

        @app.exception_handler(RequestValidationError)
        async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
            first = (e.errors() or [{}])[0]
            where = ".".join(str(p) for p in first.get("loc", ()))
            return openai_error(400, f"invalid {where}: {first.get('msg', 'invalid value')}",
                                param=where or None, code="invalid_request")

        self.rollouts.install(app, error_response)

        @app.get("/health")
        async def health() -> dict[str, Any]:  # no key needed, so it tells nothing about models
            return {"status": "ok"}

        async def list_models(request: Request) -> Any:
            data = []
            for m in self.models.values():
                ids = dict.fromkeys((self.model_id(m), m.key, f"{self.model_id(m)}@{m.step}",
                                     m.engine.spec.served_name))
                for mid in ids:
                    data.append({"id": mid, "object": "model", "created": 0, "owned_by": "tracerl"})
            return {"object": "list", "data": data}

        async def chat(request: Request, rollout_id: str | None = None) -> Any:
            return await self._handle(request, "chat.completions", rollout_id)

        async def completions(request: Request, rollout_id: str | None = None) -> Any:
            return await self._handle(request, "completions", rollout_id)

        async def responses(request: Request, rollout_id: str | None = None) -> Any:
            return await self._handle(request, "chat.completions", rollout_id, "responses")

        async def messages(request: Request, rollout_id: str | None = None) -> Any:
            return await self._handle(request, "chat.completions", rollout_id,
                                      "anthropic.messages")

        for prefix in ("", "/rollouts/{rollout_id}"):
            app.add_api_route(prefix + "/v1/models", list_models, methods=["GET"])
            app.add_api_route(prefix + "/v1/chat/completions", chat, methods=["POST"])
            app.add_api_route(prefix + "/v1/completions", completions, methods=["POST"])
            app.add_api_route(prefix + "/v1/responses", responses, methods=["POST"])
            app.add_api_route(prefix + "/v1/messages", messages, methods=["POST"])
        return app

    async def _read_body(self, request: Request) -> dict[str, Any]:
        raw = await read_limited_body(request, MAX_BODY_BYTES)
        if len(raw) > PARSE_IN_THREAD_BYTES:  # a large body must not stall the event loop
            return await asyncio.to_thread(parse_json_object, raw)
        return parse_json_object(raw)

    @staticmethod
    def _check_body(endpoint: str, body: dict[str, Any], served: ServedModel) -> None:
        config = served.engine.spec.config
        check_request(endpoint, body, max_model_len=config.max_model_len)
        if endpoint == "chat.completions":
            chars = sum(len(json.dumps(m.get("content"))) for m in body["messages"])
        else:
            chars = len(body["prompt"]) if isinstance(body["prompt"], str) else 0
        if chars > config.max_model_len * MAX_CHARS_PER_TOKEN:
            raise EngineRequestError(
                f"This model's maximum context length is {config.max_model_len} tokens; the "
                f"prompt has {chars} characters, more than that many tokens can hold",
                param="messages" if endpoint == "chat.completions" else "prompt",
                code="context_length_exceeded")

    async def _handle(self, request: Request, endpoint: str, path_rollout: str | None,
                      protocol: str | None = None) -> Any:
        """One call; a ``protocol`` (Responses, Anthropic Messages) is rendered on chat."""
        exchange: Exchange | None = None
        try:
            body = await self._read_body(request)
            if protocol is not None:
                exchange = self.protocols[protocol].begin(body)
                body = exchange.chat_body
            rollout_id = path_rollout or request.headers.get(ROLLOUT_HEADER)
            if rollout_id is not None:
                validate_name("rollout id", rollout_id)
            who = Attribution(rollout_id, parse_tags(request.headers.get(TAGS_HEADER)))
            served, engine_model, step = self._route(body.get("model"), rollout_id)
            self._check_body(endpoint, body, served)
        except (EngineRequestError, RequestError) as e:
            return error_response(e)
        except ConfigError as e:  # the rollout id
            return openai_error(e.status, str(e), param="rollout_id", code=e.code)

        engine_body = inject_training_fields(endpoint, {**body, "model": engine_model})
        route = CallRoute(who.rollout_id)  # a replica set keeps the rollout on one server
        current_route.set(route)
        timeout = served.timeout_s
        if body.get("stream"):
            if endpoint != "chat.completions":
                return error_response(EngineRequestError(
                    "streaming is supported for chat completions only", param="stream"))
            return await self._stream(served, engine_body, body, who, step, timeout, route,
                                      exchange)

        try:
            await served.swap.acquire_read(timeout)
        except EngineTimeoutError as e:
            return error_response(e)
        step = served.still_served(step, body, who.rollout_id, engine_body)
        started = time.perf_counter()
        try:
            call = (
                served.engine.chat if endpoint == "chat.completions" else served.engine.completions
            )
            # a request past its deadline is cancelled, in the engine too (vLLM: the HTTP
            # request is closed, which aborts it; transformers: its sequences stop)
            reply = call(engine_body)
            if endpoint == "chat.completions" and not _keeps_logprob_entries(body, exchange):
                reply = _without_logprob_entries(reply)
            response = await asyncio.wait_for(reply, timeout)
        except EngineRequestError as e:
            return error_response(e)
        except TimeoutError:  # the gateway's deadline, or the engine's transport
            self._schedule_restart(served.engine)
            return error_response(EngineTimeoutError(
                f"the engine did not answer within {timeout} s: set max_tokens (without it the "
                "engine may generate up to the context length) or raise "
                "EngineConfig(request_timeout_s=...)"))
        except EngineError as e:
            self._schedule_restart(served.engine)
            return error_response(EngineUnavailableError(
                f"the inference engine is unavailable and is being restarted: {e}"))
        finally:
            served.swap.release_read()
        response["model"] = body["model"]
        # a protocol answers once the record is on disk (a Responses id is remembered then)
        answer = strip_for_caller(endpoint, body, response) if exchange is None else response
        try:
            call = self._build_record(endpoint, body, response, who, step,
                                      time.perf_counter() - started, streamed=False, route=route,
                                      exchange=exchange)
            # The engine's reply holds a dict and two lists per token; with 256 calls writing at
            # once, replies kept alive over the write outlived young collections and made the
            # cyclic collector's older generations walk them again and again (gateway CPU per
            # call at c256 ~1.5x c64's, BENCHMARKS.md). The caller's answer and the record are
            # taken: the reply goes now.
            del response
            await self._write_record(served, call)
        except TracerlError as e:  # e.g. a full disk (507): the caller must not train on it
            return error_response(e)
        return JSONResponse(answer if exchange is None else exchange.answer(answer))

    async def _record(self, served: ServedModel, endpoint: str, body: dict[str, Any],
                      response: dict[str, Any] | None, who: Attribution, step: int | None,
                      latency: float, streamed: bool, error: str | None = None,
                      metadata: dict[str, Any] | None = None,
                      route: CallRoute | None = None, exchange: Exchange | None = None) -> None:
        await self._write_record(served, self._build_record(
            endpoint, body, response, who, step, latency, streamed, error=error,
            metadata=metadata, route=route, exchange=exchange))

    @staticmethod
    def _build_record(endpoint: str, body: dict[str, Any], response: dict[str, Any] | None,
                      who: Attribution, step: int | None, latency: float, streamed: bool,
                      error: str | None = None, metadata: dict[str, Any] | None = None,
                      route: CallRoute | None = None, exchange: Exchange | None = None
                      ) -> LLMCall:
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
        call.metadata.update(metadata or {})
        if route is not None and route.replica is not None:
            call.metadata["replica"] = route.replica
        if exchange is not None:
            call.metadata.update(exchange.metadata)
        return call

    async def _write_record(self, served: ServedModel, call: LLMCall) -> None:
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
                      route: CallRoute | None = None,
                      exchange: Exchange | None = None) -> Any:
        """Forward SSE chunks as they come while a task of the gateway's own assembles and
        records the call.

        The task (:meth:`_pump_stream`), not the response's generator, holds the reader count
        and releases it: a client that hangs up at any point, or a response that is never
        iterated, cannot leave the swap lock held. A hang-up cancels the task, which closes the
        engine's stream (vLLM aborts the request) and records what was generated, marked
        ``disconnected``. The record is on disk before the final event (``[DONE]``,
        ``response.completed``, ``message_stop``) is sent.
        """
        try:
            await served.swap.acquire_read(timeout)
        except EngineTimeoutError as e:
            return error_response(e)
        step = served.still_served(step, body, who.rollout_id, engine_body)
        loop = asyncio.get_running_loop()
        out: asyncio.Queue[bytes | None] = asyncio.Queue()
        first: asyncio.Future[TracerlError | None] = loop.create_future()
        pump = asyncio.create_task(self._pump_stream(
            served, engine_body, body, who, step, loop.time() + timeout, out, first, route,
            exchange))
        self._streams.add(pump)
        pump.add_done_callback(self._streams.discard)
        try:  # the first chunk is awaited here so that engine errors become proper statuses
            failed = await asyncio.shield(first)
        except asyncio.CancelledError:
            pump.cancel()
            raise
        if failed is not None:
            return error_response(failed)

        async def events() -> AsyncIterator[bytes]:
            ended = False
            try:
                while (data := await out.get()) is not None:
                    yield data
                ended = True
            finally:  # if this never runs, the pump still ends by its deadline
                if not ended:
                    pump.cancel()

        return StreamingResponse(events(), media_type="text/event-stream")

    @staticmethod
    def _stream_error_event(exchange: Exchange | None, message: str,
                            code: str | None = None) -> bytes:
        if exchange is not None:
            return exchange.error_event(message)
        payload = {"error": {"message": message, "type": "service_unavailable", "param": None,
                             "code": code}}
        return b"data: " + json.dumps(payload).encode() + b"\n\n"

    async def _pump_stream(self, served: ServedModel, engine_body: dict[str, Any],
                           body: dict[str, Any], who: Attribution, step: int | None,
                           deadline: float, out: asyncio.Queue[bytes | None],
                           first: asyncio.Future[TracerlError | None],
                           route: CallRoute | None = None,
                           exchange: Exchange | None = None) -> None:
        started = time.perf_counter()
        assembler = StreamAssembler(keep_entries=_keeps_logprob_entries(body, exchange))
        stream = served.engine.chat_stream(engine_body)
        error: str | None = None
        sent = 0
        disconnected = False
        final: list[bytes] = []  # sent once the record is on disk
        try:
            try:
                async with asyncio.timeout_at(deadline):
                    chunk = await anext(stream, None)
            except EngineRequestError as e:  # refused before generating: nothing to record
                first.set_result(e)
                return
            except TimeoutError:
                self._schedule_restart(served.engine)
                first.set_result(EngineTimeoutError(
                    f"the engine did not start the stream within {served.timeout_s} s"))
                return
            except EngineError as e:
                self._schedule_restart(served.engine)
                first.set_result(EngineUnavailableError(
                    f"the inference engine is unavailable: {e}"))
                return
            first.set_result(None)
            async with asyncio.timeout_at(deadline):
                while chunk is not None:
                    assembler.add(chunk)
                    chunk["model"] = body["model"]
                    if exchange is not None:
                        for event in exchange.stream_events(chunk):
                            out.put_nowait(event)
                    else:
                        payload = strip_for_caller("chat.completions", body, chunk)
                        out.put_nowait(b"data: " + json.dumps(payload).encode() + b"\n\n")
                    sent += 1
                    chunk = await anext(stream, None)
            final = [b"data: [DONE]\n\n"] if exchange is None else list(exchange.final_events())
        except asyncio.CancelledError:  # the client hung up (or the server is stopping)
            asyncio.current_task().uncancel()  # type: ignore[union-attr]  # record it anyway
            disconnected = True
            error = f"client disconnected after {sent} chunk(s)"
        except (EngineError, TimeoutError) as e:
            error = f"stream broke off: {e or type(e).__name__}"
            if isinstance(e, TimeoutError):
                error = f"stream broke off: the engine did not finish within {served.timeout_s} s"
            self._schedule_restart(served.engine)
            final = [self._stream_error_event(exchange, error)]
        finally:
            served.swap.release_read()  # synchronous: nothing can interrupt it
            if not first.done():
                first.set_result(EngineUnavailableError("the stream was cancelled"))
        try:
            with contextlib.suppress(Exception):  # closing vLLM's stream aborts its request
                async with asyncio.timeout(STREAM_CLOSE_TIMEOUT_S):
                    await stream.aclose()
            await self._record(served, "chat.completions", body, assembler.response(), who,
                               step, time.perf_counter() - started, streamed=True, error=error,
                               metadata={"disconnected": True} if disconnected else None,
                               route=route, exchange=exchange)
        except TracerlError as e:  # e.g. a full disk: the client hears it instead of the end
            final = [self._stream_error_event(exchange, f"the call was not recorded: {e}",
                                              e.code)]
            log.error("streamed call not recorded: %s", e)
        finally:
            for event in final:
                out.put_nowait(event)
            out.put_nowait(None)
