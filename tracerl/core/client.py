"""OpenAI clients that attribute each request to the rollout that sends it.

The rollout is read when the request is sent, not when the client is made, so one client can
be shared by any number of concurrent rollouts. Requests get the path form
``/rollouts/{id}/v1/...`` and the ``x-rollout-id`` header.
"""

from __future__ import annotations

import json
from typing import Any

import httpx2  # noqa: F401 - openai's transport: imported once, before rollouts start threads
import openai

from .context import ROLLOUT_HEADER, TAGS_HEADER, current_call_tags, current_rollout


def _attribute(request: Any, model: Any) -> None:
    tags = current_call_tags()
    if tags:
        request.headers[TAGS_HEADER] = json.dumps(tags, separators=(",", ":"))
    ctx = current_rollout()
    if ctx is None:
        return
    ctx.touch(model)
    request.headers[ROLLOUT_HEADER] = ctx.rollout_id
    path = request.url.path
    if not path.startswith("/rollouts/"):
        request.url = request.url.copy_with(path=f"/rollouts/{ctx.rollout_id}{path}")


def async_http_client(model: Any) -> Any:
    """An async HTTP client (as openai uses) that attributes requests to the current rollout;
    for frameworks that build their own OpenAI client (LangChain, ...)."""
    async def hook(request: Any) -> None:
        _attribute(request, model)

    return openai.DefaultAsyncHttpxClient(event_hooks={"request": [hook]})


def sync_http_client(model: Any) -> Any:
    def hook(request: Any) -> None:
        _attribute(request, model)

    return openai.DefaultHttpxClient(event_hooks={"request": [hook]})


def async_client(model: Any, base_url: str, api_key: str, **kwargs: Any) -> openai.AsyncOpenAI:
    http_client = async_http_client(model)
    kwargs.setdefault("max_retries", 0)  # a retry would record the call twice
    return openai.AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=http_client, **kwargs)


def sync_client(model: Any, base_url: str, api_key: str, **kwargs: Any) -> openai.OpenAI:
    http_client = sync_http_client(model)
    kwargs.setdefault("max_retries", 0)
    return openai.OpenAI(base_url=base_url, api_key=api_key, http_client=http_client, **kwargs)


def rollout_headers(model: Any) -> dict[str, str]:
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
