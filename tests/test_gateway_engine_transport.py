"""The vLLM engine's HTTP layer on its own: reply decoding, SSE line splitting and how transport
failures map to the gateway's errors (real aiohttp, real sockets; no vLLM needed)."""

import asyncio
import json
import socket

import aiohttp
import pytest

from tracerl.backend.engines.json_codec import loads
from tracerl.backend.engines.vllm_engine import sse_events, transport_errors
from tracerl.core.engine import EngineUnavailableError


def test_loads_matches_the_standard_library_and_accepts_what_orjson_refuses():
    reply = {"choices": [{"logprobs": {"content": [{"token": "é", "logprob": -0.25}]},
                          "token_ids": [1, 2**40]}], "prompt_token_ids": list(range(50))}
    raw = json.dumps(reply).encode()
    assert loads(raw) == json.loads(raw) == reply
    assert loads(raw.decode()) == reply
    special = loads(b'{"logprob": -Infinity, "x": NaN}')  # Python's JSON, orjson's refusal
    assert special["logprob"] == float("-inf") and special["x"] != special["x"]
    with pytest.raises(json.JSONDecodeError):
        loads(b'{"truncated": [1, 2')


async def test_sse_events_survive_chunk_edges_long_lines_and_stop_at_done():
    big = {"prompt_token_ids": list(range(60_000))}  # ~400 KB on one line
    body = (b': a comment\r\n\r\ndata: {"a": 1}\r\n\r\ndata: ' + json.dumps(big).encode()
            + b"\n\ndata: [DONE]\n\ndata: {\"after\": true}\n\n")

    async def serve(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body))
        for i in range(0, len(body), 7_919):  # edges fall inside lines and inside "\r\n"
            writer.write(body[i:i + 7_919])
            await writer.drain()
            await asyncio.sleep(0.001)
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{port}/stream") as r:
                events = [event async for event in sse_events(r.content)]
    finally:
        server.close()
    assert events == [{"a": 1}, big]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_an_unreachable_engine_is_unavailable_not_a_crash():
    async with aiohttp.ClientSession() as session:
        with pytest.raises(EngineUnavailableError, match="did not answer"):
            with transport_errors():
                async with session.post(f"http://127.0.0.1:{_closed_port()}/v1/chat/completions",
                                        json={}):
                    pass


async def test_an_engine_that_accepts_but_never_answers_times_out():
    async def hold(reader, writer):
        await reader.read(1)  # take the request, never answer
        await asyncio.sleep(30)

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        timeout = aiohttp.ClientTimeout(total=None, connect=5, sock_read=0.5)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            with pytest.raises(TimeoutError, match="did not answer in time"):
                with transport_errors():
                    async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                                            json={}):
                        pass
    finally:
        server.close()


async def test_an_engine_that_drops_the_connection_is_unavailable():
    async def drop(reader, writer):
        await reader.read(1)
        writer.close()

    server = await asyncio.start_server(drop, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with aiohttp.ClientSession() as session:
            with pytest.raises(EngineUnavailableError):
                with transport_errors():
                    async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                                            json={}):
                        pass
    finally:
        server.close()
