"""The inference gateway: an OpenAI-compatible endpoint in front of the engines.

One call reads straight through: the protocol that owns the route translates the request
(:mod:`.protocols`), the model table resolves the model and its adapter (:mod:`.served`), the
call is admitted past any adapter swap, the engine answers (streams: :mod:`.stream_pump`), the
recorder writes the token-exact record (:mod:`.recorder`), and the protocol renders the answer.
Rollouts are attributed by path (``/rollouts/{id}/v1/...``) or by the ``x-rollout-id`` header;
a plain call to a model in online mode is a live rollout of its own (the gateway is handed the
live calls, :class:`LiveTraffic`; :mod:`tracerl.backend.online.live_calls` implements them).
Every call is recorded before the response is returned. Errors are OpenAI-shaped: bad requests
get 4xx, an engine that is down gets 503 (and is restarted, :mod:`.supervisor`), a request that
runs past its deadline gets 504: never a hang.
"""

from __future__ import annotations

import asyncio
import typing
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ...core.engine import CallRoute, EngineError, EngineRequestError, current_route
from ...core.errors import RequestError, TracerlError
from ...core.model_name import ModelName
from ...core.storage import ModelStore
from ...core.trajectory import LLMCall
from ..engines.token_prompts import requested_max_tokens
from ..protocols.base import Protocol
from ..protocols.registry import load_protocols
from .hang_up import ClientHungUp, unless_hung_up
from .http_answers import (
    KeyRequired,
    bearer_key_check,
    error_response,
    install_error_answers,
    openai_error,
)
from .recorder import CallStore, Recorder
from .request_body import read_json_body
from .request_validation import Attribution, attribution, check_request, parse_tags
from .rollout_api import ExternalRollouts
from .served import ModelTable, ServedModel
from .stream_pump import stream_answer
from .supervisor import EngineSupervisor
from .swap_lock import SwapLock
from .turns import TurnSplicer

# the gateway's names before it was split, for code that imported them from here
__all__ = ["Attribution", "Gateway", "KeyRequired", "ModelTable", "ServedModel", "SwapLock",
           "error_response", "openai_error", "parse_tags"]

Handler = Callable[[Request, str | None], Awaitable[Response]]


class LiveTraffic(typing.Protocol):
    """What the gateway needs of online mode's live calls (which calls are live is the served
    model's: :attr:`ServedModel.live`)."""

    def recorded(self, store: ModelStore, call: LLMCall) -> None:
        """Told of each call once its record is on disk (a writer thread)."""

    def install(self, app: FastAPI, answer_error: Callable[[TracerlError], JSONResponse]
                ) -> None:
        """Add the feedback routes to ``app``."""


class Gateway:
    """The gateway's state (served models, protocols, recorder, engine supervision) and app.
    ``live``: online mode's live calls (their routes and the recorder's hook), None: none."""

    def __init__(self, api_key: str | None = None, restart_grace_s: float = 30.0, *,
                 models: ModelTable | None = None, live: LiveTraffic | None = None) -> None:
        self.check_auth = bearer_key_check(api_key)
        self.models = ModelTable() if models is None else models
        self.rollouts = ExternalRollouts(self.models)  # the rollout API for outside services
        self.live = live  # online mode: production calls and their feedback
        self.turns = TurnSplicer()  # a rollout's next prompt continues its previous tokens
        self.recorder = Recorder(CallStore(divert=self.rollouts.divert_late,
                                           after_add=None if live is None else live.recorded),
                                 self.turns)
        self.protocols: dict[str, Protocol] = {p.name: p for p in load_protocols()}
        self.supervisor = EngineSupervisor(restart_grace_s)
        self._streams: set[asyncio.Task[None]] = set()  # stream pumps in flight
        self.app = self._build_app()

    @property
    def calls(self) -> CallStore:
        """Where recorded calls are kept (per model, per rollout)."""
        return self.recorder.calls

    def add_model(self, served: ServedModel) -> None:
        self.models.add(served)

    def model_id(self, served: ServedModel) -> str:
        """The model name callers use for ``served`` (see :meth:`ModelTable.model_id`)."""
        return self.models.model_id(served)

    # --- app -------------------------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="tracerl gateway", docs_url=None, redoc_url=None)
        # before any route reads the body; the schema and unknown routes are covered too
        app.add_middleware(KeyRequired, check=self.check_auth, exempt=("/health",))
        install_error_answers(app)
        self.rollouts.install(app, error_response)
        if self.live is not None:
            self.live.install(app, error_response)

        @app.get("/health")
        async def health() -> dict[str, Any]:  # no key needed, so it tells nothing about models
            return {"status": "ok"}

        async def list_models(request: Request) -> dict[str, Any]:
            return {"object": "list", "data": [
                {"id": mid, "object": "model", "created": 0, "owned_by": "tracerl"}
                for mid in self.models.listing()]}

        for prefix in ("", "/rollouts/{rollout_id}"):
            app.add_api_route(prefix + "/v1/models", list_models, methods=["GET"])
            for protocol in self.protocols.values():
                for path in protocol.routes:
                    app.add_api_route(prefix + "/v1" + path, self._handler(protocol),
                                      methods=["POST"])
        return app

    def _handler(self, protocol: Protocol) -> Handler:
        async def handle(request: Request, rollout_id: str | None = None) -> Response:
            return await self._handle(protocol, request, rollout_id)

        return handle

    # --- one call --------------------------------------------------------------------------

    async def _handle(self, protocol: Protocol, request: Request,
                      path_rollout: str | None) -> Response:
        """One call of ``protocol``, from its request to its answer (see the module's doc)."""
        endpoint = protocol.endpoint
        try:
            exchange = protocol.begin(await read_json_body(request))
            body = exchange.chat_body
            who = attribution(path_rollout, request.headers)
            served, engine_model, step = self.models.route(body.get("model"), who.rollout_id)
            if who.rollout_id is None and served.live is not None and \
                    not ModelName.parse(body["model"]).pinned:
                # online mode: a plain call is a live rollout (canary-routed by it): its own,
                # or its session's
                who = Attribution(served.live(who.tags), who.tags)
                served, engine_model, step = self.models.route(body["model"], who.rollout_id)
            check_request(endpoint, body,
                          max_model_len=served.engine.spec.config.max_model_len)
            streamed = bool(body.get("stream"))
            if streamed and not protocol.streams:
                raise EngineRequestError(f"streaming is not supported for {protocol.name}",
                                         param="stream")
            turn = (await self.turns.splice(served.store.root, served.engine, who.rollout_id,
                                            body) if endpoint == "chat.completions" else None)
            admission, engine_model, step = await served.admit(engine_model, step,
                                                               body["model"], who.rollout_id)
        except (RequestError, EngineError) as e:  # 4xx, or 504: a swap outlasted the deadline
            return error_response(e)
        route = CallRoute(who.rollout_id)  # a replica set keeps the rollout on one server
        current_route.set(route)
        rec = self.recorder.begin(served.store, exchange, endpoint, engine_model, who, step,
                                  route, turn)
        if streamed:  # the pump holds the admission from here, until the stream ends
            return await stream_answer(served, rec, admission, self.supervisor, self._streams)

        engine = served.engine
        with admission:  # held until the engine answered or failed
            try:
                # a request past its deadline, or whose client hung up, is cancelled, in the
                # engine too (vLLM: the HTTP request is closed, which aborts it; transformers:
                # its sequences stop)
                async with asyncio.timeout(served.timeout_s):
                    response = await unless_hung_up(request.receive, (
                        engine.chat(rec.engine_body) if endpoint == "chat.completions"
                        else engine.completions(rec.engine_body)))
            except ClientHungUp:
                return Response(status_code=499)  # nginx's "client closed request": unread
            except (EngineError, TimeoutError) as e:
                return error_response(self.supervisor.failure(
                    e, engine, served.timeout_s,
                    max_tokens=requested_max_tokens(rec.engine_body)))
        response["model"] = body["model"]
        answer = exchange.answer(response)
        recording = rec.finish(response)
        # The engine's reply holds containers per choice and token; with 256 calls writing at
        # once, replies kept alive over the write outlived young collections and made the
        # cyclic collector's older generations walk them again and again (BENCHMARKS.md, the
        # c256 tail). The answer is made; our reference goes, so that finish() lets the reply go
        # once the record is built, before the write.
        del response
        try:
            await recording
        except TracerlError as e:  # e.g. a full disk (507): the caller must not train on it
            return error_response(e)
        exchange.recorded()  # e.g. a Responses id may be continued from now on
        return JSONResponse(answer)
