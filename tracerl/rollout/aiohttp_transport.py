"""openai's aiohttp transport, with network failures reported as what they are.

The transport openai vendors maps every ``aiohttp.ClientConnectionError`` it does not know
better to ``ConnectTimeout``, so a refused connection or a server that hung up mid-request
reaches the user as openai's "Request timed out" after 0.1 s. Here those become
``ConnectError`` / ``RemoteProtocolError`` / ``ReadError`` (openai's "Connection error."), and
real timeouts stay timeouts. Importing this module fails where openai has no such transport.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import httpx2
from openai._constants import DEFAULT_CONNECTION_LIMITS
from openai._vendor.httpx_aiohttp.transport import AiohttpTransport


def network_error(
    cause: BaseException, message: str, request: httpx2.Request
) -> httpx2.TransportError | None:
    """The httpx error for an aiohttp connection failure that is not a timeout (None if it is)."""
    if isinstance(cause, TimeoutError) or not isinstance(cause, aiohttp.ClientConnectionError):
        return None
    if isinstance(cause, aiohttp.ClientConnectorError):
        return httpx2.ConnectError(message, request=request)
    if isinstance(cause, aiohttp.ServerDisconnectedError):
        return httpx2.RemoteProtocolError(message, request=request)
    return httpx2.ReadError(message, request=request)


class CorrectedAiohttpTransport(AiohttpTransport):
    """The vendored transport with openai's connection limits and corrected error mapping."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("limits", DEFAULT_CONNECTION_LIMITS)
        super().__init__(**kwargs)

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        try:
            return await super().handle_async_request(request)
        except httpx2.ConnectTimeout as e:
            better = (
                network_error(e.__cause__, str(e), request) if e.__cause__ is not None else None
            )
            if better is None:
                raise
            raise better from e.__cause__
