"""Served-policy fingerprints: every recorded call carries the digest of the weights the engine
served it with; an adapter swapped behind the gateway's back (loaded into the engine directly)
is caught by the trainer (the call refused, counted, warned about) and by ``tracerl doctor``."""

import asyncio

import pytest

import tracerl
from tests.conftest import make_random_lora
from tracerl.backend.training.health import step_warnings
from tracerl.core.fingerprint import BASE, adapter_digest, check_calls
from tracerl.doctor import fingerprint_finding

MESSAGES = [{"role": "user", "content": "Say one word."}]


async def one_call(model) -> tuple[str, tracerl.core.trajectory.LLMCall]:
    with tracerl.rollout_scope() as ro:
        await model.openai_client().chat.completions.create(
            model=model.get_inference_name(), messages=MESSAGES, max_tokens=4, temperature=0.0)
    (call,) = await model.fetch_calls(ro.rollout_id)
    return ro.rollout_id, call


@pytest.fixture(scope="module")
async def fp_model(tf_backend, smollm2_path, tmp_path_factory):
    """A model serving checkpoint 1 (a random LoRA written as its checkpoint), and a second,
    different adapter that tracerl never published."""
    backend, _ = tf_backend
    model = tracerl.TrainableModel(
        name="fp", project="tests", base_model="smollm2",
        config=tracerl.ModelConfig(engine=tracerl.EngineConfig(max_model_len=256)))
    await model.register(backend)
    store = backend.store(model)
    route = backend.gateway.models[model.spec.key]
    other = tmp_path_factory.mktemp("fp") / "other"
    await asyncio.to_thread(make_random_lora, smollm2_path, store.checkpoint_dir(1), 1)
    await asyncio.to_thread(make_random_lora, smollm2_path, other, 2)
    return backend, model, store, route, other


async def test_each_call_records_the_digest_of_the_weights_that_served_it(fp_model):
    backend, model, store, route, _ = fp_model
    _, base_call = await one_call(model)
    assert (base_call.adapter_step, base_call.adapter_digest) == (0, BASE)
    await backend.call_on_gateway(route.swap_adapter(1, store.checkpoint_dir(1)))
    _, call = await one_call(model)
    want = adapter_digest(store.checkpoint_dir(1))
    assert want.startswith("sha256:") and (call.adapter_step, call.adapter_digest) == (1, want)
    check = check_calls(store.checkpoints_dir, [base_call, call])
    assert (check.checked, check.unverified, check.refused) == (2, 0, set())


async def test_an_adapter_swapped_behind_the_gateways_back_is_caught(fp_model):
    """The engine gets other weights under the served name: the route still says policy@1, the
    record says what really served it; the step refuses that call and trains on the other."""
    backend, model, store, route, other = fp_model
    await backend.call_on_gateway(route.swap_adapter(1, store.checkpoint_dir(1)))
    assert route.step == 1
    await backend.call_on_gateway(route.engine.load_adapter(route.adapter_name, other))
    bad_id, bad = await one_call(model)
    assert bad.adapter_step == 1 and bad.adapter_digest == adapter_digest(other)
    assert bad.adapter_digest != adapter_digest(store.checkpoint_dir(1))
    await backend.call_on_gateway(route.engine.load_adapter(route.adapter_name,
                                                            store.checkpoint_dir(1)))
    good_id, good = await one_call(model)
    assert good.adapter_digest == adapter_digest(store.checkpoint_dir(1))

    check = check_calls(store.checkpoints_dir, [bad, good])
    assert check.refused == {bad.id} and "claims policy@1" in check.examples[0]
    finding = fingerprint_finding(store.root)
    assert finding.status == "fail" and "1 calls were served by other weights" in finding.detail

    def trajectory(rid: str, call, reward: float) -> tracerl.Trajectory:
        choice = call.response["choices"][0]
        return tracerl.Trajectory(messages_and_choices=[*MESSAGES, choice], reward=reward,
                                  llm_calls=[call], rollout_id=rid)

    group = tracerl.TrajectoryGroup([trajectory(bad_id, bad, 0.0), trajectory(good_id, good, 1.0)])
    m = await model.train([group], config=tracerl.TrainConfig(learning_rate=1e-6))
    assert (m["fingerprint_mismatches"], m["fingerprint_checked"], m["rows"]) == (1.0, 2.0, 1.0)
    warning = next(w for w in step_warnings(m) if w.item == "fingerprint_mismatches")
    assert "other weights than the policy version they claim" in warning.message
