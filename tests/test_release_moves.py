"""Promote and rollback under concurrent callers, through a real gateway (transformers engine,
SmolLM2): the first move of a model not yet under release control, and every move after it,
fail no call, and every answered call carries the digest of the version it claims."""

from __future__ import annotations

import asyncio
import uuid

import httpx

import tracerl
from tests.conftest import make_random_lora, until
from tracerl.backend.online.release import ReleaseControl
from tracerl.core.fingerprint import BASE, adapter_digest

CALLERS = 24
# a short system message: SmolLM2's template adds a 15-token default one to a prompt without
# (prefill is most of a call on CPU)
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Name a color."}]


async def _callers(backend, name: str, stop: asyncio.Event, answered: list[str],
                   failed: list[str]) -> None:
    """``CALLERS`` callers calling ``name`` back to back until ``stop``; the rollout ids
    answered and the failures (status and text) go to ``answered`` and ``failed``."""

    async def caller(http: httpx.AsyncClient) -> None:
        while not stop.is_set():
            rid = f"move-{uuid.uuid4().hex[:12]}"
            r = await http.post("/chat/completions", headers={"x-rollout-id": rid}, json={
                "model": name, "max_tokens": 2, "temperature": 0.0, "messages": MESSAGES})
            (answered if r.status_code == 200 else failed).append(
                rid if r.status_code == 200 else f"{r.status_code} {r.text[:200]}")

    limits = httpx.Limits(max_connections=CALLERS)
    async with httpx.AsyncClient(base_url=backend.base_url, timeout=120, limits=limits) as http:
        await asyncio.gather(*(caller(http) for _ in range(CALLERS)))


async def _moves_under_traffic(backend, model, moves: list[tuple[str, int]]) -> None:
    store = backend.store(model)
    control = ReleaseControl(backend, model)
    stop = asyncio.Event()
    answered: list[str] = []
    failed: list[str] = []
    traffic = asyncio.ensure_future(_callers(backend, model.get_inference_name(), stop,
                                             answered, failed))

    async def calls_answered() -> None:  # calls in flight on the version before, and after
        seen = len(answered)
        await until(lambda: len(answered) >= seen + CALLERS or traffic.done(),
                    f"{CALLERS} more answered calls", timeout_s=300)

    try:
        for action, step in moves:
            await calls_answered()
            move = control.promote if action == "promote" else control.rollback
            assert (await move(step)).incumbent == step
        await calls_answered()
    finally:
        stop.set()
        await traffic
    assert failed == [], f"{len(failed)} of {len(failed) + len(answered)} calls failed: " \
                         f"{failed[:5]}"
    steps = set()
    for rid in answered:
        (call,) = await model.fetch_calls(rid)
        step = call.adapter_step
        want = BASE if step == 0 else adapter_digest(store.checkpoint_dir(step))
        assert call.adapter_digest == want, (rid, step, call.adapter_digest)
        steps.add(step)
    assert len(answered) > 3 * len(moves) and len(steps) > 1, (len(answered), steps)


async def _model_with_checkpoints(backend, smollm2_path, name: str, resident: int):
    model = tracerl.TrainableModel(
        name=name, project="tests", base_model="smollm2",
        config=tracerl.ModelConfig(engine=tracerl.EngineConfig(
            max_model_len=256, resident_adapters=resident)))
    store = backend.store(model)
    for step in (1, 2, 3):
        await asyncio.to_thread(make_random_lora, smollm2_path, store.checkpoint_dir(step), step)
    await model.register(backend)  # serves its newest checkpoint, 3, not under release control
    return model


async def test_the_first_promote_and_every_move_after_it_fail_no_call(tf_backend, smollm2_path):
    backend, _ = tf_backend
    model = await _model_with_checkpoints(backend, smollm2_path, "moves", 1)
    await _moves_under_traffic(backend, model, [("promote", 1), ("rollback", 0),
                                                ("promote", 3), ("rollback", 2)])


async def test_the_first_rollback_of_a_model_with_resident_versions_fails_no_call(
        tf_backend, smollm2_path):
    backend, _ = tf_backend
    model = await _model_with_checkpoints(backend, smollm2_path, "moves-resident", 3)
    await _moves_under_traffic(backend, model, [("rollback", 2), ("promote", 3)])


async def test_retiring_a_version_waits_for_its_calls_alone(tf_backend, smollm2_path):
    """Promoting 2 retires version 1 while a long call on 1 decodes: the promotion waits for
    that call, and the calls routed to 2 meanwhile are answered before it ends (a swap that
    held every new call stalled an online run's calls for minutes)."""
    backend, _ = tf_backend
    model = await _model_with_checkpoints(backend, smollm2_path, "retire", 1)
    control = ReleaseControl(backend, model)
    name = model.get_inference_name()
    route = backend.gateway.models[name]
    await control.promote(1)
    async with httpx.AsyncClient(base_url=backend.base_url, timeout=300) as http:
        long = asyncio.ensure_future(http.post("/completions", json={
            "model": f"{name}@1", "prompt": "1, 2, 3, 4, 5, 6,", "max_tokens": 160,
            "temperature": 0.0}))
        await until(lambda: route.swap.readers == 1, "the long call on version 1 to start",
                    timeout_s=60)
        promotion = asyncio.ensure_future(control.promote(2))
        await until(lambda: 1 not in route.versions, "version 1 to be retired", timeout_s=60)
        short = await http.post("/chat/completions", headers={"x-rollout-id": "short"}, json={
            "model": name, "max_tokens": 2, "temperature": 0.0, "messages": MESSAGES})
        assert short.status_code == 200, short.text
        assert not long.done() and not promotion.done()  # the retire waits for the long call
        assert (await long).json()["choices"][0]["finish_reason"] == "length"
    assert (await asyncio.wait_for(promotion, 60)).incumbent == 2
    assert sorted(route.versions) == [2, 3]
    (call,) = await model.fetch_calls("short")
    assert call.adapter_step == 2
    assert call.adapter_digest == adapter_digest(backend.store(model).checkpoint_dir(2))
