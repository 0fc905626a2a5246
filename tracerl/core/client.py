"""OpenAI clients that attribute each request to the rollout that sends it.

The rollout is read when the request is sent, not when the client is made, so one client can
be shared by any number of concurrent rollouts. Requests get the path form
``/rollouts/{id}/v1/...`` and the ``x-rollout-id`` header.
"""

from __future__ import annotations

from typing import Any

import httpx  # noqa: F401 - loaded up front: openai probes it lazily, racily across threads
import openai

from .context import ROLLOUT_HEADER, current_rollout


def _attribute(request: Any, model: Any) -> None:
    ctx = current_rollout()
    if ctx is None:
        return
    ctx.touch(model)
    request.headers[ROLLOUT_HEADER] = ctx.rollout_id
    path = request.url.path
    if not path.startswith("/rollouts/"):
        request.url = request.url.copy_with(path=f"/rollouts/{ctx.rollout_id}{path}")


def async_client(model: Any, base_url: str, api_key: str, **kwargs: Any) -> openai.AsyncOpenAI:
    async def hook(request: Any) -> None:
        _attribute(request, model)

    http_client = openai.DefaultAsyncHttpxClient(event_hooks={"request": [hook]})
    kwargs.setdefault("max_retries", 0)  # a retry would record the call twice
    return openai.AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=http_client, **kwargs)


def sync_client(model: Any, base_url: str, api_key: str, **kwargs: Any) -> openai.OpenAI:
    def hook(request: Any) -> None:
        _attribute(request, model)

    http_client = openai.DefaultHttpxClient(event_hooks={"request": [hook]})
    kwargs.setdefault("max_retries", 0)
    return openai.OpenAI(base_url=base_url, api_key=api_key, http_client=http_client, **kwargs)
