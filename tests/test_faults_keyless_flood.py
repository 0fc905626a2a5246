"""A flood of half-sent keyless requests cannot lock out clients that hold the key.

The real gateway (``LocalBackend`` with an API key: its uvicorn, tracerl's protocol) in this
process; the flood is a second process (``benchmarks/keyless_flood.py flood``) holding thousands
of connections from 127.0.0.2, each with half a request head and no key, reopening each one the
server ends. Before the admission caps, 4,200 of them made uvicorn's ``limit_concurrency``
answer 503 to every call and to ``/health`` until they closed.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

import tracerl
from benchmarks.keyless_flood import timed_get  # the benchmark's own GET

FLOOD_SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "keyless_flood.py"
KEY = "sk-test-flood"
FLOOD_ADDRESS = "127.0.0.2"
DEADLINE_S = 30.0  # generous for a loaded box: before the caps the answer was a 503 at once


@pytest.fixture
async def gateway(tmp_path, monkeypatch) -> AsyncIterator[tuple[str, int, object]]:
    monkeypatch.setenv("TRACERL_HEAD_TIMEOUT_S", "120")  # the flood is never cut by the deadline
    monkeypatch.setenv("TRACERL_MAX_UNKEYED_PER_CLIENT", "1024")  # the default, stated here
    backend = tracerl.LocalBackend(path=tmp_path, api_key=KEY)
    thread = backend._gateway()
    yield thread.host, thread.port, thread.server.server_state
    await backend.close()


@pytest.fixture
def flood(gateway) -> Iterator[dict[str, int]]:
    """4,200 half-sent keyless connections from one address, held (and reopened) until the test
    ends; the flood's counts when each connection has been tried once."""
    host, port, _ = gateway
    proc = subprocess.Popen([sys.executable, str(FLOOD_SCRIPT), "flood", host, str(port), "4200"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        yield json.loads(proc.stdout.readline())  # the script gives up itself after 120 s
    finally:
        proc.terminate()
        proc.wait(30)


async def get(host: str, port: int, path: str, key: str | None = None) -> int:
    """The status of one GET on a fresh connection from 127.0.0.1 (0: closed unanswered)."""
    status, _ = await timed_get(host, port, path, key, "127.0.0.1")
    return status


async def test_keyed_calls_and_health_answer_during_a_keyless_flood(gateway, flood):
    host, port, state = gateway
    assert flood["ready"]
    for _ in range(10):
        async with asyncio.timeout(DEADLINE_S):
            assert await get(host, port, "/v1/models", KEY) == 200
            assert await get(host, port, "/health") == 200
            assert await get(host, port, "/v1/models") == 401  # the key still matters
    from_flood = [c for c in list(state.connections) if c.client and c.client[0] == FLOOD_ADDRESS]
    assert len(from_flood) <= 1024  # the per-address cap on connections without the key


async def test_a_keyed_connection_never_counts_against_its_address(gateway):
    """Keep-alive connections that presented the key stay open past the cap of their address,
    which applies only to connections that have not."""
    host, port, state = gateway
    admission = None
    writers = []
    try:
        for _ in range(5):
            reader, writer = await asyncio.open_connection(host, port)
            writers.append(writer)
            writer.write(f"GET /v1/models HTTP/1.1\r\nHost: g\r\nAuthorization: Bearer {KEY}"
                         "\r\n\r\n".encode())
            assert (await asyncio.wait_for(reader.readline(), DEADLINE_S)).split()[1] == b"200"
        admission = state.tracerl_admission
        assert "127.0.0.1" not in admission.by_client  # five keyed connections: none counted
        assert sum(1 for c in state.connections if c.keyed) >= 5
    finally:
        for w in writers:
            w.close()
