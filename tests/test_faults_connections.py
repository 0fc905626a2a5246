"""Connections the server cuts: real uvicorn with tracerl's protocol, real sockets.

When the head deadline cuts a client that is still sending, the server must send a FIN and keep
reading, so no byte is left unread when the socket closes (an unread byte turns the close into a
reset, which destroys whatever the client has not read yet). A client that ignores the FIN is
dropped ``LINGER_S`` later.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import pytest
import uvicorn

from tracerl.backend.http_limits import LINGER_S, uvicorn_options

HEAD_TIMEOUT_S = 1.0
TRICKLERS = 200


async def _ok(scope, receive, send) -> None:  # a plain ASGI app
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture
async def server(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[uvicorn.Server]:
    monkeypatch.setenv("TRACERL_HEAD_TIMEOUT_S", str(HEAD_TIMEOUT_S))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(_ok, log_level="warning", **uvicorn_options()))
    serving = asyncio.ensure_future(server.serve(sockets=[sock]))
    async with asyncio.timeout(30):  # the startup event, polled: uvicorn offers no awaitable
        while not server.started:
            await asyncio.sleep(0.01)
    server.port = sock.getsockname()[1]
    yield server
    server.should_exit = True
    await asyncio.wait_for(serving, 30)


async def _trickle_head(port: int) -> bytes:
    """Send a request head a byte each millisecond until the server closes; what it sent back."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = b"POST /x HTTP/1.1\r\nHost: a\r\nX-Pad: " + b"a" * 20_000
    closed = asyncio.ensure_future(reader.read(-1))
    try:
        for i in range(len(head)):
            if closed.done():
                break
            writer.write(head[i:i + 1])
            await asyncio.wait([closed], timeout=0.001)
        return await asyncio.wait_for(closed, 10)
    finally:
        writer.close()


async def test_clients_cut_mid_head_see_the_connection_end_not_a_reset(server):
    """200 clients trickling their heads when the deadline cuts them: every one reads an end of
    stream. (Closed outright, 37 to 188 of 200 got ECONNRESET in each of six runs.)"""
    answers = await asyncio.gather(*[_trickle_head(server.port) for _ in range(TRICKLERS)],
                                   return_exceptions=True)
    failures = [a for a in answers if a != b""]
    assert not failures, f"{len(failures)} of {TRICKLERS}: {failures[:3]}"


async def test_a_client_that_ignores_the_fin_is_dropped_after_the_linger(server):
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:
        assert await asyncio.wait_for(reader.read(-1), HEAD_TIMEOUT_S + 10) == b""
        assert len(server.server_state.connections) == 1  # lingering: still reading
        with pytest.raises(ConnectionError):  # the socket went: the next write is refused
            async with asyncio.timeout(LINGER_S + 10):
                while True:
                    writer.write(b"x")
                    await writer.drain()
                    await asyncio.sleep(0.05)  # a trickle, not a wait for the server
    finally:
        writer.close()
    async with asyncio.timeout(10):
        while server.server_state.connections:
            await asyncio.sleep(0.01)


async def test_a_client_that_closes_after_the_fin_frees_its_slot_at_once(server):
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    assert await asyncio.wait_for(reader.read(-1), HEAD_TIMEOUT_S + 10) == b""
    writer.close()
    async with asyncio.timeout(LINGER_S / 2):  # well before the linger would have dropped it
        while server.server_state.connections:
            await asyncio.sleep(0.01)
