"""The transformers engine's continuous batching (issue 40): a call joins the decoding rows at the
next step and leaves when it ends, a newcomer's prefill is bounded per step so decoding rows keep
moving, admission is first come first served, a caller that leaves stops its rows, and every
sampled token's logprob is that of the request's own processed distribution."""

from __future__ import annotations

import asyncio

import pytest

from tracerl.backend.engines.transformers_engine import TransformersEngine
from tracerl.core.config import EngineConfig, LoraConfig
from tracerl.core.engine import EngineSpec

from .conftest import until

COUNTING = "1, 2, 3, 4, 5, 6,"  # greedy SmolLM2 keeps counting: a call that runs to max_tokens


async def _engine(path, **config) -> TransformersEngine:
    engine = TransformersEngine(EngineSpec(path, path.name, EngineConfig(**config), LoraConfig()))
    await engine.start()
    return engine


@pytest.fixture(scope="module")
async def engine(smollm2_path):
    engine = await _engine(smollm2_path, max_model_len=1024)
    yield engine
    await engine.stop()


def _body(engine, prompt, max_tokens, **kw):
    return {"model": engine.spec.served_name, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0.0, **kw}


async def _stream(engine, content, max_tokens, log, name, **kw):
    body = {"model": engine.spec.served_name, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 0.0, **kw}
    async for chunk in engine.chat_stream(body):
        if chunk["choices"] and "token_ids" in chunk["choices"][0]:
            log.append(name)


async def test_a_call_joins_while_a_long_one_decodes_and_answers_before_it(engine):
    long = asyncio.ensure_future(engine.completions(_body(engine, COUNTING, 120)))
    batcher = engine._batcher_impl
    await until(lambda: batcher.decoding, "the long call to decode", 120)
    short = await engine.completions(_body(engine, "The capital of France is", 4))
    assert not long.done()  # answered while the long call still decodes
    assert len(short["choices"][0]["token_ids"]) == 4
    assert (await long)["choices"][0]["finish_reason"] == "length"
    assert len((await long)["choices"][0]["token_ids"]) == 120


async def test_greedy_answers_in_a_busy_batch_are_those_alone(engine):
    prompts = [COUNTING, "The capital of France is", "Once upon a time, a cat"]
    alone = [await engine.completions(_body(engine, p, 12)) for p in prompts]
    together = await asyncio.gather(*(engine.completions(_body(engine, p, 12)) for p in prompts))
    for a, t in zip(alone, together, strict=True):
        (ca,), (ct,) = a["choices"], t["choices"]
        assert ca["token_ids"] == ct["token_ids"]
        assert ct["logprobs"]["token_logprobs"] == pytest.approx(
            ca["logprobs"]["token_logprobs"], abs=1e-4)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
async def test_sampled_logprobs_are_the_processed_distributions(engine, temperature, top_p):
    """Recomputed from scratch over prompt + completion, with the request's temperature and
    top-p applied as ``generate`` applies them, for calls sampled in one batch."""
    import torch
    from transformers import AutoModelForCausalLM, TemperatureLogitsWarper, TopPLogitsWarper

    prompts = ["Write a poem about the sea.", "Name three fruits:", COUNTING]
    answers = await asyncio.gather(*(engine.completions(_body(
        engine, p, 16, temperature=temperature, top_p=top_p, n=2)) for p in prompts))
    model = AutoModelForCausalLM.from_pretrained(engine.spec.model_path, dtype=torch.float32)
    for answer in answers:
        assert len(answer["choices"]) == 2
        for choice in answer["choices"]:
            prompt, ids = choice["prompt_token_ids"], choice["token_ids"]
            with torch.no_grad():
                logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1: -1]
            scores = TemperatureLogitsWarper(temperature)(None, logits.float())
            if top_p < 1:
                scores = TopPLogitsWarper(top_p)(None, scores)
            want = torch.log_softmax(scores, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
            assert choice["logprobs"]["token_logprobs"] == pytest.approx(want.tolist(), abs=1e-3)


async def test_a_long_prompt_is_prefilled_in_chunks_while_rows_keep_decoding(engine):
    batcher = engine._batcher_impl
    batcher.prefill_tokens = 16
    log: list[str] = []
    try:
        long = asyncio.ensure_future(_stream(engine, "Count from 1 to 100.", 80, log, "long"))
        await until(lambda: "long" in log, "the long call's first token", 120)
        prompt = "Summarise: " + "the quick brown fox jumps over the lazy dog. " * 12
        submitted = len(log)
        await _stream(engine, prompt, 2, log, "new")
        await long
    finally:
        batcher.prefill_tokens = 256
    between = log[submitted: log.index("new")].count("long")
    assert between >= 6  # its ~130 prompt tokens took 9 steps, each moving the long row


async def test_a_caller_that_leaves_stops_its_rows_and_others_carry_on(engine):
    batcher = engine._batcher_impl
    gone = asyncio.ensure_future(engine.completions(_body(engine, COUNTING, 400)))
    log: list[str] = []
    stream = asyncio.ensure_future(_stream(engine, "Count from 1 to 100.", 400, log, "s"))
    await until(lambda: len(batcher.decoding) == 2, "both calls to decode", 120)
    gone.cancel()
    stream.cancel()
    await until(lambda: not batcher.decoding, "the left calls' rows to leave", 60)
    answer = await engine.completions(_body(engine, "The capital of France is", 3))
    assert len(answer["choices"][0]["token_ids"]) == 3


async def test_admission_is_first_come_first_served(smollm2_path):
    engine = await _engine(smollm2_path, max_model_len=512, max_num_seqs=2)
    batcher = engine._batcher_impl
    try:
        busy = []
        for i in range(2):  # both rows taken by calls that run to max_tokens
            busy.append(asyncio.ensure_future(engine.completions(_body(engine, COUNTING, 100))))
            await until(lambda i=i: len(batcher.decoding) == i + 1, "a busy call decoding", 120)
        log: list[str] = []
        waiting = []
        for i in range(3):  # queued one after the other, while no row is free
            waiting.append(asyncio.ensure_future(
                _stream(engine, f"Say {i}.", 3, log, str(i))))
            await until(lambda i=i: batcher.queue.qsize() + len(batcher._waiting) == i + 1,
                        "a call waiting for a row", 60)
        assert not log
        await asyncio.gather(*busy, *waiting)
        assert sorted("012", key=log.index) == ["0", "1", "2"]
    finally:
        await engine.stop()


async def test_a_stream_yields_tokens_as_they_are_sampled(engine):
    batcher = engine._batcher_impl
    body = {"model": engine.spec.served_name, "max_tokens": 40, "temperature": 0.0,
            "messages": [{"role": "user", "content": "Count from 1 to 100."}]}
    stream = engine.chat_stream(body)
    first = await anext(stream)
    assert first["choices"][0]["delta"]["role"] == "assistant"
    token = await anext(stream)
    assert token["choices"][0]["token_ids"] and batcher.decoding  # still generating
    await stream.aclose()  # the caller leaves
    await until(lambda: not batcher.decoding, "the closed stream's row to leave", 60)
