"""The vLLM engine's HTTP layer on its own: reply decoding, SSE line splitting and how transport
failures map to the gateway's errors (real aiohttp, real sockets; no vLLM needed)."""

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest

from tracerl.backend.engines.json_codec import loads
from tracerl.backend.engines.vllm_engine import sse_events, transport_errors
from tracerl.core.engine import EngineUnavailableError

REPLY = {"choices": [{"logprobs": {"content": [{"token": "é", "logprob": -0.25}]},
                      "token_ids": [1, 2**40]}], "prompt_token_ids": list(range(50))}


@pytest.mark.parametrize("raw", [json.dumps(REPLY).encode(), json.dumps(REPLY)],
                         ids=["bytes", "str"])
def test_loads_decodes_a_reply_as_the_standard_library_does(raw):
    assert loads(raw) == json.loads(raw) == REPLY


def test_loads_accepts_nan_and_infinity_that_orjson_refuses():
    special = loads(b'{"logprob": -Infinity, "x": NaN}')  # Python's JSON, orjson's refusal
    assert special["logprob"] == float("-inf")
    assert special["x"] != special["x"]  # NaN is the only float unequal to itself


NOT_JSON = {
    "truncated": b'{"truncated": [1, 2',
    "empty": b"",
    "trailing-garbage": b'{"a": 1} x',
    "single-quotes": b"{'a': 1}",
}


@pytest.mark.parametrize("raw", NOT_JSON.values(), ids=list(NOT_JSON))
def test_loads_raises_the_standard_decode_error_on_bad_json(raw):
    with pytest.raises(json.JSONDecodeError):
        loads(raw)


@contextlib.asynccontextmanager
async def local_server(handle: Callable[[asyncio.StreamReader, asyncio.StreamWriter],
                                        Awaitable[None]]) -> AsyncIterator[str]:
    """A raw TCP server on 127.0.0.1 running ``handle`` per connection; yields its URL."""
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


async def events_of(body: bytes, piece: int = 7_919) -> list:
    """The events ``sse_events`` reads from a server that sends ``body`` in pieces of ``piece``
    bytes (7,919: a prime, so edges fall inside lines and inside ``\\r\\n``)."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body))
        for i in range(0, len(body), piece):
            writer.write(body[i:i + piece])
            await writer.drain()
            # the condition under test, not a wait: a pause between pieces so that they reach
            # the client as separate reads instead of one coalesced buffer
            await asyncio.sleep(0.001)
        writer.close()

    async with local_server(serve) as url, aiohttp.ClientSession() as session:
        async with session.get(f"{url}/stream") as r:
            return [event async for event in sse_events(r.content)]


def many_events(n: int) -> tuple[bytes, list]:
    events = [{"i": i, "text": "x" * (i % 50)} for i in range(n)]
    return b"".join(b"data: " + json.dumps(e).encode() + b"\r\n\r\n" for e in events), events


BIG = {"prompt_token_ids": list(range(60_000))}  # ~400 KB on one line
SSE_BODIES = {
    # id: (the body the server sends, the events read from it)
    "events-across-piece-edges": many_events(2_000),
    "line-longer-than-aiohttp-buffer": (b"data: " + json.dumps(BIG).encode() + b"\n\n", [BIG]),
    "comments-and-blank-lines-skipped": (b': a comment\r\n\r\n\r\nevent: x\ndata: {"a": 1}\n\n',
                                         [{"a": 1}]),
    "lf-and-crlf-endings": (b'data: {"a": 1}\n\ndata: {"b": 2}\r\n\r\n', [{"a": 1}, {"b": 2}]),
    "data-without-space": (b'data:{"a": 1}\n\n', [{"a": 1}]),
    "nothing-after-done": (b'data: {"a": 1}\n\ndata: [DONE]\n\ndata: {"after": true}\n\n',
                           [{"a": 1}]),
}


@pytest.mark.parametrize("body, expected", SSE_BODIES.values(), ids=list(SSE_BODIES))
async def test_sse_events_yield_each_data_payload_up_to_done(body, expected):
    assert await events_of(body) == expected


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def take_request_then_wait_for_hang_up(reader: asyncio.StreamReader,
                                             writer: asyncio.StreamWriter) -> None:
    """The stalled engine: reads the request, never answers, returns once the client hangs up."""
    await reader.read(1)
    await reader.read()  # EOF: the client gave up


async def take_request_then_drop(reader: asyncio.StreamReader,
                                 writer: asyncio.StreamWriter) -> None:
    await reader.read(1)
    writer.close()


async def post_through_transport_errors(url: str) -> None:
    timeout = aiohttp.ClientTimeout(total=None, connect=5, sock_read=0.5)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        with transport_errors():
            async with session.post(f"{url}/v1/chat/completions", json={}):
                pass


async def test_an_unreachable_engine_is_unavailable_not_a_crash():
    with pytest.raises(EngineUnavailableError, match="did not answer"):
        await post_through_transport_errors(f"http://127.0.0.1:{closed_port()}")


async def test_an_engine_that_accepts_but_never_answers_times_out():
    async with local_server(take_request_then_wait_for_hang_up) as url:
        with pytest.raises(TimeoutError, match="did not answer in time"):
            await post_through_transport_errors(url)


async def test_an_engine_that_drops_the_connection_is_unavailable():
    async with local_server(take_request_then_drop) as url:
        with pytest.raises(EngineUnavailableError, match="did not answer"):
            await post_through_transport_errors(url)
