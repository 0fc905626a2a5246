"""The transformers engine's adapters: whatever order calls of the base model, of one adapter and
of several at once come in, each is answered by its own weights; the model's adapter is set only
when a forward needs another (peft's setters walk every loaded adapter: per decoded token, a
model with many versions loaded decoded several times slower); an unloaded adapter is deleted
from the model, its name refused, and a call of it still in flight fails alone."""

from __future__ import annotations

import asyncio

import pytest

from tracerl.backend.engines.transformers_engine import TransformersEngine
from tracerl.core.config import EngineConfig, LoraConfig
from tracerl.core.engine import EngineRequestError, EngineSpec

from .conftest import make_random_lora, until

PROMPT = "The capital of France is"
COUNTING = "1, 2, 3, 4, 5, 6,"  # greedy SmolLM2 keeps counting: a call that runs to max_tokens


def _body(model: str, prompt: str = PROMPT, max_tokens: int = 16) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}


async def _ids(engine: TransformersEngine, model: str, **kw) -> list[int]:
    return (await engine.completions(_body(model, **kw)))["choices"][0]["token_ids"]


@pytest.fixture(scope="module")
async def served(smollm2_path, tmp_path_factory):
    """An engine serving two random adapters, and each model's greedy answer taken when it was
    the only thing the model had been asked for since the adapter loaded."""
    spec = EngineSpec(smollm2_path, smollm2_path.name, EngineConfig(max_model_len=512),
                      LoraConfig())
    engine = TransformersEngine(spec)
    await engine.start()
    base = spec.served_name
    alone = {base: await _ids(engine, base)}  # before any adapter: a plain transformers model
    for name, seed in (("a", 1), ("b", 2)):
        await engine.load_adapter(name, make_random_lora(smollm2_path,
                                                         tmp_path_factory.mktemp(name), seed))
        alone[name] = await _ids(engine, name)
    assert len({tuple(ids) for ids in alone.values()}) == 3  # each adapter changes the answer
    yield engine, alone
    await engine.stop()


async def test_each_call_is_answered_by_its_own_weights_in_any_order(served):
    engine, alone = served
    base = engine.spec.served_name
    for model in ("a", base, "b", "a", base, base, "b"):
        assert await _ids(engine, model) == alone[model], model
    together = [base, "a", "b", "a"]  # one batch of several adapters: peft routes each row
    answers = await asyncio.gather(*(_ids(engine, m) for m in together))
    assert answers == [alone[m] for m in together]
    for model in ("b", base, "a"):  # and single models after it
        assert await _ids(engine, model) == alone[model], model


async def test_peft_sets_the_adapter_on_a_change_not_per_token(served, monkeypatch):
    from peft import PeftModel

    engine, _ = served
    calls: list[str] = []
    original = PeftModel.set_adapter

    def counted(self, name, *args, **kwargs):
        calls.append(name)
        return original(self, name, *args, **kwargs)

    monkeypatch.setattr(PeftModel, "set_adapter", counted)
    await _ids(engine, "a", max_tokens=30)
    await _ids(engine, "a", max_tokens=30)
    await _ids(engine, "b", max_tokens=30)
    a, b = engine._peft_name("a"), engine._peft_name("b")  # peft's names for them
    assert calls in ([b], [a, b])  # 93 forwards: "a" only if it was not the one set already


async def test_a_call_of_an_adapter_unloaded_while_it_decodes_fails_alone(served,
                                                                          smollm2_path,
                                                                          tmp_path):
    engine, alone = served
    base = engine.spec.served_name
    await engine.load_adapter("c", make_random_lora(smollm2_path, tmp_path / "c", seed=3))
    peft_name = engine._peft_name("c")
    batcher = engine._batcher_impl
    doomed = asyncio.ensure_future(engine.completions(_body("c", COUNTING, 300)))
    other = asyncio.ensure_future(engine.completions(_body(base, COUNTING, 40)))
    await until(lambda: len(batcher.decoding) == 2, "both calls to decode", 120)
    await engine.unload_adapter("c")
    with pytest.raises(EngineRequestError) as refused:
        await doomed
    assert refused.value.status == 404 and refused.value.param == "model"
    answer = (await other)["choices"][0]
    assert answer["finish_reason"] == "length" and len(answer["token_ids"]) == 40
    assert peft_name not in engine.model.peft_config  # its weights left the model
    with pytest.raises(EngineRequestError) as unknown:
        await _ids(engine, "c")
    assert unknown.value.status == 404
    for model in (base, "a", "b"):  # the others are served as before
        assert await _ids(engine, model) == alone[model], model
