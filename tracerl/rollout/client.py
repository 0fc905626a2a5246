"""OpenAI clients that attribute each request to the rollout that sends it.

The rollout is read when the request is sent, not when the client is made, so one client can
be shared by any number of concurrent rollouts. Requests get the path form
``/rollouts/{id}/v1/...`` and the ``x-rollout-id`` header.

Async clients made inside an event loop use aiohttp when it is installed (httpx's pool scans
every connection per request: 1.3-1.6x fewer rollouts/s at 64-256 concurrent rollouts,
BENCHMARKS.md) and close themselves when that loop shuts down.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

import httpx2  # openai's transport: imported once, before rollouts start threads
import openai

from ..core.context import ROLLOUT_HEADER, TAGS_HEADER, current_call_tags, current_rollout

if TYPE_CHECKING:
    from .model import Model

log = logging.getLogger(__name__)
CLOSED_KEY = "closed_at"  # set in a rollout's metadata when its calls have been collected
# calls sent from a tracerl client that no trajectory will hold, by reason
unattributed_calls: dict[str, int] = {"no_rollout": 0, "rollout_closed": 0}


def _unattributed(reason: str, message: str, *args: object) -> None:
    unattributed_calls[reason] += 1
    if unattributed_calls[reason] in (1, 10, 100, 1000):  # warn, without flooding the log
        log.warning(message + " (%d such calls so far)", *args, unattributed_calls[reason])


def _attribute(request: httpx2.Request, model: Model) -> None:
    tags = current_call_tags()
    if tags:
        request.headers[TAGS_HEADER] = json.dumps(tags, separators=(",", ":"))
    ctx = current_rollout()
    if ctx is None:
        _unattributed("no_rollout", "a call to %s was sent outside any rollout, so no "
                      "trajectory holds it and it is not trained on; fix: make it inside a "
                      "rollout run by gather_trajectory_groups(...) or in `with rollout_scope():`",
                      request.url.path)
        return
    if CLOSED_KEY in ctx.metadata:
        _unattributed("rollout_closed", "a call was sent by rollout %s after it finished, so its "
                      "trajectory misses it; fix: await every task and stream the rollout starts "
                      "before returning from it", ctx.rollout_id)
    ctx.touch(model)
    ctx.last_call, ctx.last_call_at = f"{request.method} {request.url.path}", time.time()
    request.headers[ROLLOUT_HEADER] = ctx.rollout_id
    path = request.url.path
    if not path.startswith("/rollouts/"):
        request.url = request.url.copy_with(path=f"/rollouts/{ctx.rollout_id}{path}")


def async_http_client(model: Model, *, aiohttp: bool = False) -> httpx2.AsyncClient:
    """An async HTTP client (as openai uses) that attributes requests to the current rollout;
    for frameworks that build their own OpenAI client (LangChain, ...). ``aiohttp``: openai's
    aiohttp transport, for a client that stays in one event loop."""
    async def hook(request: httpx2.Request) -> None:
        _attribute(request, model)

    if not aiohttp:
        return openai.DefaultAsyncHttpxClient(event_hooks={"request": [hook]})
    from .aiohttp_transport import CorrectedAiohttpTransport

    return openai.DefaultAioHttpClient(event_hooks={"request": [hook]},
                                       transport=CorrectedAiohttpTransport())


def sync_http_client(model: Model) -> httpx2.Client:
    def hook(request: httpx2.Request) -> None:
        _attribute(request, model)

    return openai.DefaultHttpxClient(event_hooks={"request": [hook]})


def _has_aiohttp() -> bool:
    """openai's aiohttp transport is usable: aiohttp installed, and an openai that vendors it."""
    try:
        from . import aiohttp_transport  # noqa: F401
    except ImportError:
        return False
    return True


async def _close_at_shutdown(client: openai.AsyncOpenAI) -> AsyncGenerator[None, None]:
    try:
        yield
    finally:  # run by the loop's shutdown_asyncgens(), which asyncio.run() calls on exit
        await client.close()


def close_with_loop(client: openai.AsyncOpenAI, loop: asyncio.AbstractEventLoop
                    ) -> AsyncGenerator[None, None]:
    """Make ``client`` close when ``loop`` shuts down its async generators (``asyncio.run``
    does, before closing the loop). Returns the generator: the caller keeps it referenced,
    because the loop holds its async generators weakly."""
    closer = _close_at_shutdown(client)
    loop.create_task(closer.__anext__())  # registers it with the loop, runs it to its yield
    return closer


def loop_client(model: Model, base_url: str, api_key: str, loop: asyncio.AbstractEventLoop,
                **kwargs: Any) -> tuple[openai.AsyncOpenAI, AsyncGenerator[None, None]]:
    """An async client for use in ``loop`` only, on aiohttp where installed, closed with the
    loop; returns it with the handle to keep (see :func:`close_with_loop`)."""
    client = async_client(model, base_url, api_key, aiohttp=_has_aiohttp(), **kwargs)
    return client, close_with_loop(client, loop)


def async_client(model: Model, base_url: str, api_key: str, *, aiohttp: bool = False,
                 **kwargs: Any) -> openai.AsyncOpenAI:
    kwargs.setdefault("max_retries", 0)  # a retry would record the call twice
    return openai.AsyncOpenAI(base_url=base_url, api_key=api_key,
                              http_client=async_http_client(model, aiohttp=aiohttp), **kwargs)


def sync_client(model: Model, base_url: str, api_key: str, **kwargs: Any) -> openai.OpenAI:
    http_client = sync_http_client(model)
    kwargs.setdefault("max_retries", 0)
    return openai.OpenAI(base_url=base_url, api_key=api_key, http_client=http_client, **kwargs)


def rollout_headers(model: Model) -> dict[str, str]:
    """Headers that attribute a request made by other means (a subprocess, another language,
    a proxy) to the current rollout; the rollout then collects ``model``'s records of it."""
    ctx = current_rollout()
    if ctx is None:
        raise RuntimeError("rollout_headers() needs a running rollout (gather or rollout_scope)")
    ctx.touch(model)
    headers = {ROLLOUT_HEADER: ctx.rollout_id}
    if tags := current_call_tags():
        headers[TAGS_HEADER] = json.dumps(tags, separators=(",", ":"))
    return headers
