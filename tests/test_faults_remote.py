"""RemoteBackend against misbehaving servers (a real asyncio socket server on loopback): one
that trickles its answer a byte at a time, drops the training stream, forgets the model in a
loop, redirects, or answers with an HTML page, empty JSON or a garbage line. Each operation
must end within its deadline and retry budget, with a bounded number of requests, in an error
that names the server and what it answered."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Awaitable, Callable

import pytest

import tracerl
from tracerl.core.errors import (
    BackendUnavailableError,
    BadAnswerError,
    NotRegisteredError,
    RemoteError,
    TrainingError,
)

from .faults_support import CONFIG, tiny_groups

Reply = Callable[[str, str, asyncio.StreamWriter], Awaitable[None]]


def response(status: int, body: bytes | str, content_type: str = "application/json",
             extra: str = "") -> bytes:
    body = body.encode() if isinstance(body, str) else body
    return (f"HTTP/1.1 {status} X\r\ncontent-type: {content_type}\r\ncontent-length: "
            f"{len(body)}\r\nconnection: close\r\n{extra}\r\n").encode() + body


REGISTERED = json.dumps({"model_name": "m", "step": 0, "gateway_path": "/v1"})
HTML = "<html><head><title>Welcome to nginx</title></head><body>hi</body></html>"
NOT_REGISTERED = json.dumps({"error": {"message": "model faults/m is not registered",
                                       "code": "model_not_registered"}})


class BadServer:
    """Answers every request with ``reply(method, path, writer)``; counts requests per path."""

    def __init__(self, reply: Reply) -> None:
        self.reply, self.requests = reply, Counter()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode()
            method, path, _ = head.split(" ", 2)
            length = next((int(line.split(":")[1]) for line in head.split("\r\n")
                           if line.lower().startswith("content-length:")), 0)
            await reader.readexactly(length)
            self.requests[method + " " + path] += 1
            await self.reply(method, path, writer)
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()


async def registered_or(path: str, writer: asyncio.StreamWriter, otherwise: bytes) -> None:
    writer.write(response(200, REGISTERED) if path.endswith("/models") else otherwise)


async def timed(operation: Awaitable) -> tuple[BaseException | None, float]:
    started = time.monotonic()
    try:
        await operation
    except Exception as e:
        return e, time.monotonic() - started
    return None, time.monotonic() - started


def model() -> tracerl.TrainableModel:
    return tracerl.TrainableModel(name="m", project="faults", base_model="smollm2", config=CONFIG)


async def test_a_trickling_server_is_cut_off_by_one_deadline_per_operation():
    async def trickle(method: str, path: str, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                     b"content-length: 100000\r\n\r\n")
        for _ in range(100000):  # the fault: one byte every 0.2 s, each read well in time
            writer.write(b" ")
            await writer.drain()
            await asyncio.sleep(0.2)

    bad = BadServer(trickle)
    async with bad as url:
        backend = tracerl.RemoteBackend(url, timeout_s=1.0, retry_for_s=2.0)
        error, took = await timed(backend.status())
        await backend.close()
    assert isinstance(error, BackendUnavailableError), error
    assert url in str(error) and "deadline" in str(error)
    assert took < 8 and 1 < bad.requests["GET /api/v1/status"] <= 6


async def test_a_training_stream_trickling_a_line_is_cut_off_per_event():
    async def trickle_train(method: str, path: str, writer: asyncio.StreamWriter) -> None:
        if path.endswith("/models"):
            writer.write(response(200, REGISTERED))
            return
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")
        for _ in range(100000):  # one byte of a line that never ends
            writer.write(b"1\r\n{\r\n")
            await writer.drain()
            await asyncio.sleep(0.2)

    bad = BadServer(trickle_train)
    async with bad as url:
        backend = tracerl.RemoteBackend(url, timeout_s=1.0, retry_for_s=2.0)
        m = model()
        await m.register(backend)
        error, took = await timed(m.train(tiny_groups(1)))
        await backend.close()
    assert isinstance(error, TrainingError) and url in str(error), error
    assert "deadline" in str(error) and took < 8


async def test_a_server_dropping_the_training_stream_is_retried_with_backoff_then_given_up():
    async def drop(method: str, path: str, writer: asyncio.StreamWriter) -> None:
        await registered_or(path, writer, b"HTTP/1.1 200 OK\r\ncontent-type: application/"
                            b"x-ndjson\r\nconnection: close\r\n\r\n{\"event\": \"accepted\"}\n")

    bad = BadServer(drop)
    async with bad as url:
        backend = tracerl.RemoteBackend(url, retry_for_s=3.0)
        m = model()
        await m.register(backend)
        error, took = await timed(m.train(tiny_groups(1)))
        await backend.close()
    trains = bad.requests["POST /api/v1/models/faults/m/train"]
    assert isinstance(error, TrainingError) and "stream ended" in str(error), error
    assert url in str(error) and 2 <= trains <= 8 and took < 10


async def test_a_server_that_keeps_forgetting_the_model_is_given_up_after_a_few_registrations():
    async def forget(method: str, path: str, writer: asyncio.StreamWriter) -> None:
        await registered_or(path, writer, response(404, NOT_REGISTERED))

    bad = BadServer(forget)
    async with bad as url:
        backend = tracerl.RemoteBackend(url, retry_for_s=30.0)
        m = model()
        await m.register(backend)
        error, _ = await timed(m.train(tiny_groups(1)))
        step_error, _ = await timed(m.get_step())
        await backend.close()
    assert isinstance(error, NotRegisteredError) and "again after 3" in str(error), error
    assert isinstance(step_error, NotRegisteredError)
    assert bad.requests["POST /api/v1/models/faults/m/train"] == 4
    assert bad.requests["POST /api/v1/models"] == 1 + 3 + 1  # first, 3 for train, 1 for get_step


ANSWERS = {  # id: (reply, operation, error class, words the error must contain, max requests)
    "redirect": (response(302, "", extra="location: https://elsewhere.example/api\r\n"), "status",
                 BadAnswerError, ["redirected", "https://elsewhere.example/api"], 1),
    "html-200": (response(200, HTML, "text/html"), "status", BadAnswerError,
                 ["HTML page", "Welcome to nginx"], 8),
    "html-502": (response(502, HTML, "text/html"), "status", BackendUnavailableError,
                 ["HTML page", "Welcome to nginx"], 8),
    "html-404": (response(404, HTML, "text/html"), "status", RemoteError,
                 ["HTML page", "HTTP 404"], 1),
    "empty-json": (response(200, "{}"), "register", BadAnswerError,
                   ["gateway_path", "'{}'"], 8),
    "garbage-line": (response(200, "not json at all\n", "application/x-ndjson"), "train",
                     TrainingError, ["not a JSON event", "not json at all"], 8),
}


@pytest.mark.parametrize("answer, operation, error_class, words, most", ANSWERS.values(),
                         ids=list(ANSWERS))
async def test_errors_name_the_server_and_what_it_answered(answer, operation, error_class, words,
                                                          most):
    async def reply(method: str, path: str, writer: asyncio.StreamWriter) -> None:
        if operation == "train":
            await registered_or(path, writer, answer)
        else:
            writer.write(answer)

    bad = BadServer(reply)
    async with bad as url:
        backend = tracerl.RemoteBackend(url, retry_for_s=1.5)
        m = model()
        if operation == "train":
            await m.register(backend)
        run = {"status": backend.status, "register": lambda: m.register(backend),
               "train": lambda: m.train(tiny_groups(1))}[operation]
        error, took = await timed(run())
        await backend.close()
    assert isinstance(error, error_class), repr(error)
    for word in [url, *words]:
        assert word in str(error), (word, str(error))
    assert sum(bad.requests.values()) - (operation == "train") <= most and took < 6
