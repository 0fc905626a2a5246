"""HTTP answers shared by the gateway and ``tracerl serve``'s control API: OpenAI-shaped errors,
the API-key check, and the handlers that turn framework errors into those answers."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ...core.errors import AuthenticationError, TracerlError, error_type

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
KeyCheck = Callable[[Request], JSONResponse | None]


def openai_error(status: int, message: str, *, param: str | None = None,
                 code: str | None = None) -> JSONResponse:
    """An OpenAI-shaped error answer (the gateway's and the control API's). A lone surrogate
    the message or param repeats from the request is written as its escape: the answer is
    UTF-8, and an error about a bad value must not fail on that value."""
    message = message.encode("utf-8", "backslashreplace").decode()
    param = None if param is None else param.encode("utf-8", "backslashreplace").decode()
    return JSONResponse(status_code=status, content={
        "error": {"message": message, "type": error_type(status), "param": param, "code": code}})


def error_response(e: TracerlError) -> JSONResponse:
    """The answer for one of tracerl's errors: its status and code from the error tree."""
    return openai_error(e.status, str(e), param=getattr(e, "param", None), code=e.code)


def bearer_key_check(api_key: str | None) -> KeyCheck:
    """A check that refuses a request without ``Authorization: Bearer <api_key>`` (none: all
    pass). The comparison takes the same time whatever the key sent."""

    def check(request: Request) -> JSONResponse | None:
        if api_key is None:
            return None
        auth = request.headers.get("authorization", "")
        token = auth[7:] if auth.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(token.encode(), api_key.encode()):
            return error_response(AuthenticationError(
                "Incorrect or missing API key (send Authorization: Bearer <key>)"))
        return None

    return check


class KeyRequired:
    """ASGI middleware: answer a request that ``check`` refuses before any route runs.

    Plain ASGI rather than ``@app.middleware("http")``: Starlette's ``BaseHTTPMiddleware`` wraps
    every request and response in a task group and a memory stream, a per-call cost the gateway
    pays hundreds of times a second (``benchmarks/rollout_throughput.py`` with
    ``benchmarks/instant_vllm``).
    """

    def __init__(self, app: ASGIApp, *, check: KeyCheck, exempt: tuple[str, ...] = (),
                 only_under: str = "/") -> None:
        self.app, self.check, self.exempt, self.only_under = app, check, exempt, only_under

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] == "http" and scope["path"] not in self.exempt
                and scope["path"].startswith(self.only_under)
                and (denied := self.check(Request(scope))) is not None):
            await denied(scope, receive, send)
            return
        await self.app(scope, receive, send)


def install_error_answers(app: FastAPI) -> None:
    """Unknown routes, framework HTTP errors and invalid path parameters answered OpenAI's way."""

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
