"""model.openai_client(): one client per event loop, on aiohttp, closed when its loop shuts down.

The echo server only reflects what the client sends (path, rollout header); the client is real."""

import asyncio
import json
import subprocess
import sys
import textwrap

import tracerl
from tests.echo_server import EchoServer

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def test_client_closes_with_its_loop_and_the_next_loop_gets_a_new_one():
    server = EchoServer()
    model = tracerl.Model(
        name="m", project="p", inference_base_url=server.url, inference_api_key="k"
    )

    async def call():
        client = model.openai_client()
        assert model.openai_client() is client  # one per loop
        with tracerl.rollout_scope() as rollout:
            r = await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}]
            )
        seen = json.loads(r.choices[0].message.content)
        assert seen["header"] == rollout.rollout_id
        assert seen["path"] == f"/rollouts/{rollout.rollout_id}/v1/chat/completions"
        return client

    try:
        first = asyncio.run(call())
        assert first.is_closed()  # asyncio.run shut the loop down, and the client with it
        second = asyncio.run(call())
        assert second is not first and second.is_closed()
    finally:
        server.close()


def test_an_art_style_script_exits_without_unclosed_session_warnings():
    server = EchoServer()
    script = textwrap.dedent(f"""
        import asyncio, tracerl
        model = tracerl.Model(name="m", project="p", inference_base_url={server.url!r},
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
    try:
        out = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT
        )
    finally:
        server.close()
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["20", "20"]
    assert "Unclosed" not in out.stderr, out.stderr


class _Socket:
    """A TCP server that accepts and then hangs up (``hang_up``) or stays silent."""

    def __init__(self, hang_up: bool) -> None:
        import socket
        import threading

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


def test_network_failures_are_connection_errors_and_timeouts_stay_timeouts():
    import time

    import openai
    import pytest

    from tests.remote_server import free_port

    def call(url, **client_kwargs):
        model = tracerl.Model(name="m", project="p", inference_base_url=url, inference_api_key="k")

        async def run():
            await model.openai_client(**client_kwargs).chat.completions.create(
                model="m", messages=[{"role": "user", "content": "x"}])
        started = time.monotonic()
        with pytest.raises(openai.APIError) as info:
            asyncio.run(run())
        return info.value, time.monotonic() - started

    refused, took = call(f"http://127.0.0.1:{free_port()}/v1")
    assert type(refused) is openai.APIConnectionError and took < 5, repr(refused)  # not "timed out"
    hung_up = _Socket(hang_up=True)
    try:
        error, _ = call(hung_up.url)
        assert type(error) is openai.APIConnectionError, repr(error)
    finally:
        hung_up.close()
    silent = _Socket(hang_up=False)
    try:
        error, took = call(silent.url, timeout=0.5)
        assert type(error) is openai.APITimeoutError and took < 10, repr(error)
    finally:
        silent.close()
