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
    model = tracerl.Model(name="m", project="p", inference_base_url=server.url, inference_api_key="k")

    async def call():
        client = model.openai_client()
        assert model.openai_client() is client  # one per loop
        with tracerl.rollout_scope() as rollout:
            r = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
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
        model = tracerl.Model(name="m", project="p", inference_base_url={server.url!r}, inference_api_key="k")

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
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                             cwd=ROOT)
    finally:
        server.close()
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["20", "20"]
    assert "Unclosed" not in out.stderr, out.stderr
