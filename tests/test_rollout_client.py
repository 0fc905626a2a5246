"""model.openai_client(): one client per event loop, on aiohttp, closed when its loop shuts down.

The echo server only reflects what the client sends (path, rollout header); the client is real."""

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import openai
import pytest

import tracerl
from tests.echo_server import EchoServer
from tests.remote_server import free_port

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def echo():
    server = EchoServer()
    yield server
    server.close()


def echo_model(server):
    return tracerl.Model(name="m", project="p", inference_base_url=server.url,
                         inference_api_key="k")


async def ask(client):
    r = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}])
    return json.loads(r.choices[0].message.content)


def test_one_client_per_event_loop(echo):
    model = echo_model(echo)

    async def twice():
        return model.openai_client(), model.openai_client()

    first, again = asyncio.run(twice())
    assert first is again


def test_the_client_closes_when_its_loop_shuts_down(echo):
    model = echo_model(echo)

    async def use():
        client = model.openai_client()
        await ask(client)
        return client

    client = asyncio.run(use())
    assert client.is_closed()  # asyncio.run shut the loop down, and the client with it


def test_the_next_event_loop_gets_a_new_client(echo):
    model = echo_model(echo)

    async def use():
        client = model.openai_client()
        await ask(client)
        return client

    first = asyncio.run(use())
    second = asyncio.run(use())
    assert second is not first


def test_a_call_in_a_rollout_carries_its_id_in_header_and_path(echo):
    model = echo_model(echo)

    async def call():
        with tracerl.rollout_scope() as rollout:
            seen = await ask(model.openai_client())
        return rollout.rollout_id, seen

    rollout_id, seen = asyncio.run(call())
    assert seen["header"] == rollout_id
    assert seen["path"] == f"/rollouts/{rollout_id}/v1/chat/completions"


def test_an_unregistered_model_says_what_to_do():
    m = tracerl.TrainableModel(name="m", project="p", base_model="smollm2")
    with pytest.raises(tracerl.NotRegisteredError, match=r"await model.register\(backend\)"):
        m.openai_client()


def test_an_art_style_script_exits_without_unclosed_session_warnings(echo):
    script = textwrap.dedent(f"""
        import asyncio, tracerl
        model = tracerl.Model(name="m", project="p", inference_base_url={echo.url!r},
                              inference_api_key="k")

        async def phase():
            async def rollout(i):
                r = await model.openai_client().chat.completions.create(
                    model="m", messages=[{{"role": "user", "content": str(i)}}])
                return tracerl.Trajectory(messages_and_choices=[r.choices[0]], reward=1.0)
            groups = await tracerl.gather_trajectory_groups(
                [tracerl.TrajectoryGroup(rollout(i) for i in range(20))], show_progress=False)
            print(len(groups[0]))

        asyncio.run(phase())   # training scripts often run phases in separate loops
        asyncio.run(phase())
    """)
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["20", "20"]
    assert "Unclosed" not in out.stderr, out.stderr


# --- network failures ------------------------------------------------------------------------


class Socket:
    """A TCP server that accepts and then hangs up (``hang_up``) or stays silent."""

    def __init__(self, hang_up: bool) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1"
        self.held = []

        def serve():
            while True:
                try:
                    conn, _ = self.sock.accept()
                except OSError:
                    return
                conn.recv(65536)
                if hang_up:
                    conn.close()
                else:
                    self.held.append(conn)

        threading.Thread(target=serve, daemon=True).start()

    def close(self):
        self.sock.close()
        for c in self.held:
            c.close()


@contextlib.contextmanager
def endpoint(kind):
    """A URL that refuses connections, hangs up, or accepts and never answers."""
    if kind == "refused":
        yield f"http://127.0.0.1:{free_port()}/v1"
        return
    server = Socket(hang_up=kind == "hangs-up")
    try:
        yield server.url
    finally:
        server.close()


def call_fails(url, **client_kwargs):
    """The error a chat completion against ``url`` raises, and how long it took."""
    model = tracerl.Model(name="m", project="p", inference_base_url=url, inference_api_key="k")

    async def run():
        await model.openai_client(**client_kwargs).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}])

    started = time.monotonic()
    with pytest.raises(openai.APIError) as info:
        asyncio.run(run())
    return info.value, time.monotonic() - started


NETWORK_FAILURES = {
    # a refused connection fails at once, as a connection error (not "timed out")
    "refused": ({}, openai.APIConnectionError, 5),
    "hangs-up": ({}, openai.APIConnectionError, 30),
    "silent": ({"timeout": 0.5}, openai.APITimeoutError, 10),
}


@pytest.mark.parametrize("kind", NETWORK_FAILURES, ids=list(NETWORK_FAILURES))
def test_network_failures_raise_the_openai_error_for_what_happened(kind):
    client_kwargs, error_type, within_s = NETWORK_FAILURES[kind]
    with endpoint(kind) as url:
        error, took = call_fails(url, **client_kwargs)
    assert type(error) is error_type, repr(error)
    assert took < within_s
