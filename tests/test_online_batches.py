"""Rewards that would overflow a group's arithmetic never reach a step, and an online batch that
fails training is set aside after ``batch_tries`` tries so that the loop moves on -- recorded
append-only, in the online status, and not resurrected by a restart (a new backend on the same
folder). Real OnlineLoop, real gateway (transformers engine, SmolLM2), real training steps."""

from __future__ import annotations

import json
import logging

import httpx
import pytest

import tracerl
from tracerl.backend.online.batches import FAILED_BATCHES
from tracerl.backend.online.live_calls import events_path
from tracerl.backend.online.loop import OnlineLoop, online_config
from tracerl.core.errors import InvalidTrajectoryError
from tracerl.core.storage import read_jsonl
from tracerl.core.trajectory import read_groups_jsonl

CONFIG = tracerl.ModelConfig(engine=tracerl.EngineConfig(max_model_len=256))
ONLINE = {"group_size": 2, "groups_per_step": 1, "batch_tries": 2,
          "train": {"learning_rate": 1e-4}}


def _model() -> tracerl.TrainableModel:
    return tracerl.TrainableModel(name="aside", project="tests", base_model="smollm2",
                                  config=CONFIG)


async def _calls(backend, model, task: str, n: int) -> list[str]:
    async with httpx.AsyncClient(base_url=backend.base_url, timeout=60) as http:
        ids = []
        for _ in range(n):
            r = await http.post("/chat/completions",
                                headers={"x-tracerl-tags": json.dumps({"task": task})},
                                json={"model": model.name, "max_tokens": 3, "temperature": 1.0,
                                      "messages": [{"role": "user", "content": "Say hi."}]})
            assert r.status_code == 200, r.text
            ids.append(r.json()["id"])
        return ids


async def test_a_reward_that_overflows_a_group_is_refused_before_a_step_naming_it(tf_backend):
    backend, model = tf_backend
    store = backend.store(model)
    step, saved = store.latest_step(), sorted(store.root.rglob("*.jsonl"))
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    group = tracerl.TrajectoryGroup([tracerl.Trajectory(messages_and_choices=chat, reward=r)
                                     for r in (1e308, 1e308)])
    with pytest.raises(InvalidTrajectoryError, match=r"groups\[0\].trajectories\[0\].reward"):
        await model.train([group])
    assert store.latest_step() == step and sorted(store.root.rglob("*.jsonl")) == saved


async def test_a_batch_that_fails_training_is_set_aside_and_stays_aside_after_a_restart(
        tmp_path, caplog):
    backend = tracerl.LocalBackend(path=tmp_path, engine="transformers")
    model = _model()
    await model.register(backend)
    loop = OnlineLoop(backend, model, online_config(ONLINE))
    await loop.start()
    for reward, response_id in zip((1e308, 9e307), await _calls(backend, model, "bad", 2),
                                   strict=True):
        # as a server before the reward bound took them: the group's mean overflows
        backend.live_calls.feedback(response_id, reward, {})
    with pytest.raises(InvalidTrajectoryError, match="reward"):
        await loop.tick()  # the first try fails; run() logs it and ticks again
    assert loop.status()["failing_batches"] == {"online-0001": 1}
    with caplog.at_level(logging.ERROR, logger="tracerl.backend.online.batches"):
        assert await loop.tick() == "set aside"
    assert "online-0001 set aside after 2 failed tries" in caplog.text
    status = loop.status()
    assert status["set_aside_batches"] == ["online-0001"] and status["failing_batches"] == {}
    assert "reward" in status["last_set_aside_error"]
    assert await loop.tick() == "collecting"  # not retried
    await backend.close()

    backend = tracerl.LocalBackend(path=tmp_path, engine="transformers")  # a restart
    try:
        await model.register(backend)
        loop = OnlineLoop(backend, model, online_config(ONLINE))
        await loop.start()
        assert loop.status()["set_aside_batches"] == ["online-0001"]
        assert await loop.tick() == "collecting"  # the set-aside batch is not resurrected
        async with httpx.AsyncClient(base_url=backend.base_url, timeout=60) as http:
            for reward, response_id in enumerate(await _calls(backend, model, "good", 2)):
                r = await http.post(f"/feedback/{response_id}", json={"reward": reward})
                assert r.status_code == 200, r.text
        assert await loop.tick() == "trained"  # the loop moved on
        assert loop.trained == [1] and loop.status()["candidate"] == 1
    finally:
        await backend.close()
    store = backend.store(model)
    taken = [e for e in read_jsonl(events_path(store)) if e["event"] == "taken"]
    assert [e["batch"] for e in taken] == ["online-0001", "online-0001-1"]
    records = read_jsonl(store.root / "online" / FAILED_BATCHES)
    assert [(r["event"], r["batch"]) for r in records] == [
        ("failed", "online-0001"), ("failed", "online-0001"), ("set_aside", "online-0001")]
    trained = {t.metadata["task"] for g in read_groups_jsonl(
        store.trajectories_path("train", 1)) for t in g.trajectories}
    assert trained == {"task:good"}
