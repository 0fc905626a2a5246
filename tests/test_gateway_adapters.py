"""Serving many adapters of one base (issue 32) on the transformers engine: calls of three
models, each with its own adapter, decode in one step and each is recorded token-exactly
under its model; one model's adapter swap never holds another model's calls."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

import tracerl

from .conftest import make_random_lora, until

MSGS = [{"role": "user", "content": "Name a colour."}]


async def _greedy(model: tracerl.TrainableModel) -> tuple[object, tracerl.LLMCall]:
    with tracerl.rollout_scope() as ro:
        r = await model.openai_client().chat.completions.create(
            model=model.name, messages=MSGS, max_tokens=5, temperature=0.0, logprobs=True)
    (call,) = await model.fetch_calls(ro.rollout_id)
    return r, call


@pytest.fixture(scope="module")
async def three(tf_backend, smollm2_path, tmp_path_factory):
    """Three models on the session's engine, each serving a random adapter of its own."""
    backend, _ = tf_backend
    models = [tracerl.TrainableModel(name=f"trio-{i}", project="tests", base_model="smollm2")
              for i in range(3)]
    root = tmp_path_factory.mktemp("trio")
    for i, m in enumerate(models):
        await m.register(backend)
        adapter = await asyncio.to_thread(make_random_lora, smollm2_path, root / str(i), i + 1)
        await backend.call_on_gateway(backend.gateway.models[m.spec.key].swap_adapter(1, adapter))
    engine = backend.gateway.models[models[0].spec.key].engine
    alone = [await _greedy(m) for m in models]  # one at a time: steps of one adapter
    batcher = engine._batcher_impl
    steps: list[set[str | None]] = []
    decode = batcher._decode

    def counted(model, events):  # the real decode step, its rows' adapters noted
        steps.append({row.job.adapter for row in batcher._rows})
        return decode(model, events)

    batcher._decode = counted
    engine._lock.acquire()  # the engine is busy: the three calls queue up meanwhile
    try:
        calls = asyncio.ensure_future(asyncio.gather(*(_greedy(m) for m in models)))
        await until(lambda: batcher.queue.qsize() + len(batcher._waiting) == 3,
                    "three calls queued", 120)
    finally:
        engine._lock.release()
    try:
        together = await calls
    finally:
        del batcher._decode
    return SimpleNamespace(models=models, alone=alone, together=together, steps=steps)


def test_calls_of_three_adapters_decode_in_one_step(three):
    assert any(len(adapters) == 3 for adapters in three.steps)


def test_each_adapter_answers_in_the_batch_as_alone_and_records_under_its_model(three):
    texts = set()
    for m, (_, call_alone), (r, call) in zip(three.models, three.alone, three.together,
                                                   strict=True):
        assert call.model == m.name and call.adapter_step == 1
        got = call.completions[0]
        assert got.token_ids == call_alone.completions[0].token_ids  # greedy: the same tokens
        assert got.logprobs == pytest.approx(call_alone.completions[0].logprobs, abs=1e-4)
        assert got.text == r.choices[0].message.content
        assert [lp.logprob for lp in r.choices[0].logprobs.content] == got.logprobs
        texts.add(tuple(got.token_ids))
    assert len(texts) > 1  # the adapters differ: a batch of one adapter would answer alike


async def test_a_swap_of_one_model_never_holds_another_models_calls(three, tf_backend,
                                                                   smollm2_path, tmp_path):
    """Model A's swap waits for a call of A in flight (a read of A's swap lock, taken on the
    gateway's loop as a call takes it) and holds A's new calls; a call of model B completes
    meanwhile, recorded under B; A's swap finishes once A's call ends."""
    backend, _ = tf_backend
    a, b = three.models[:2]
    route_a = backend.gateway.models[a.spec.key]
    adapter = await asyncio.to_thread(make_random_lora, smollm2_path, tmp_path / "next", 9)

    async def release() -> None:
        admission.release()

    admission = await backend.call_on_gateway(route_a.swap.admit(60))  # A's call in flight
    swap = asyncio.ensure_future(backend.call_on_gateway(route_a.swap_adapter(2, adapter)))
    try:
        await until(lambda: "a swap holds new requests" in route_a.swap.describe(),
                    "A's swap to wait for A's call", 60)
        r_b, call_b = await asyncio.wait_for(_greedy(b), timeout=120)
        assert call_b.model == b.name and call_b.adapter_step == 1
        assert r_b.choices[0].message.content == call_b.completions[0].text
        assert not swap.done()  # still waiting for A's call
    finally:
        await backend.call_on_gateway(release())
    await asyncio.wait_for(swap, timeout=120)
    assert route_a.step == 2
