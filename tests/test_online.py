"""Online mode's live calls on a real gateway (transformers engine, SmolLM2): a plain call is a
live rollout keyed by its response id; the feedback route validates before it writes, answers
404 / 409 naming the id; calls expire by count and by age (counted); groups form by task key
and a batch id retakes the same groups; the live-call log replays past a torn line and logs a
recorded call it missed (a crash between the two writes); the calls of one ``session`` (an
agent's episode) are one rollout, rewarded once and trained as one trajectory."""

from __future__ import annotations

import json
import time

import httpx
import pytest

import tracerl
from tracerl.backend.gateway.rollout_api import build_groups
from tracerl.backend.online.live_calls import LiveCalls, _ModelLive, events_path
from tracerl.backend.online.loop import OnlineLoop, online_config
from tracerl.core.errors import ConfigError
from tracerl.core.storage import read_jsonl

CONFIG = tracerl.ModelConfig(engine=tracerl.EngineConfig(max_model_len=256))


async def _online(tf_backend, name: str, **config):
    backend, _ = tf_backend
    model = tracerl.TrainableModel(name=name, project="tests", base_model="smollm2",
                                   config=CONFIG)
    await model.register(backend)
    loop = OnlineLoop(backend, model, online_config(config))
    await loop.start()
    return backend, model, loop


async def _call(http: httpx.AsyncClient, model, task: str = "colors") -> str:
    r = await http.post("/chat/completions", headers={"x-tracerl-tags": json.dumps({"task": task})},
                        json={"model": model.name, "max_tokens": 2, "temperature": 0.0,
                              "messages": [{"role": "user", "content": "Name a color."}]})
    assert r.status_code == 200, r.text
    return r.json()["id"]


def _gateway(backend) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=backend.base_url, timeout=60)


async def test_feedback_is_validated_before_it_is_written_and_names_the_response_id(tf_backend):
    backend, model, loop = await _online(tf_backend, "live-feedback")
    store = backend.store(model)
    async with _gateway(backend) as http:
        response_id = await _call(http, model)
        (event,) = read_jsonl(events_path(store))
        assert event["event"] == "call" and event["response_id"] == response_id
        assert event["rollout_id"].startswith("live-") and event["task"] == "task:colors"
        (call,) = await model.fetch_calls(event["rollout_id"])  # the record, under its rollout
        assert call.response["id"] == response_id and call.adapter_step == 0

        before = events_path(store).read_bytes()
        for body, field in (({"reward": "high"}, "reward"), ({"thumbs": "sideways"}, "thumbs"),
                            ({}, "reward"), ({"reward": 1.0, "thumbs": "up"}, "reward"),
                            ({"reward": 1.0, "stars": 5}, "stars"),
                            ({"reward": 1.0, "metrics": {"len": "long"}}, "metrics.len"),
                            ({"reward": 1e308}, "reward"), ({"reward": -1.5e6}, "reward"),
                            ({"reward": 1.0, "metrics": []}, "metrics"),
                            ({"reward": 1.0, "metrics": 0}, "metrics"),
                            ({"reward": 1.0, "metrics": False}, "metrics"),
                            ([1, 2], "body")):
            r = await http.post(f"/feedback/{response_id}", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == field, (body, r.text)
        r = await http.post(f"/feedback/{response_id}", content=b'{"reward": -' + b"7" * 5000
                            + b"}", headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "reward", r.text
        r = await http.post("/feedback/bad..id", json={"reward": 1.0})
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_id"
        r = await http.post("/feedback/chatcmpl-unknown", json={"reward": 1.0})
        assert r.status_code == 404 and "chatcmpl-unknown" in r.json()["error"]["message"]
        assert events_path(store).read_bytes() == before  # nothing written for any of them

        r = await http.post(f"/feedback/{response_id}", json={"thumbs": "up"})
        assert r.status_code == 200 and r.json()["reward"] == 1.0
        r = await http.post(f"/feedback/{response_id}", json={"reward": 0.0})
        assert r.status_code == 409 and response_id in r.json()["error"]["message"]
        r = await http.get(f"/feedback/{response_id}")
        assert r.json()["state"] == "rewarded" and r.json()["task"] == "task:colors"
    assert loop.status()["rewarded_waiting"] == 1


async def test_calls_expire_by_count_and_by_age_and_are_counted(tf_backend):
    backend, model, loop = await _online(tf_backend, "live-expiry", max_pending=2)
    store = backend.store(model)
    async with _gateway(backend) as http:
        ids = [await _call(http, model) for _ in range(3)]
        assert await loop.tick() == "collecting"  # 3 waiting, 2 kept: the oldest expires
        counts = loop.status()
        assert counts["expired_unrewarded"] == 1 and counts["waiting_for_feedback"] == 2
        r = await http.post(f"/feedback/{ids[0]}", json={"reward": 1.0})
        assert r.status_code == 409 and ids[0] in r.json()["error"]["message"]
        assert "expired" in r.json()["error"]["message"]
        assert (await http.post(f"/feedback/{ids[1]}", json={"reward": 0.5})).status_code == 200
    live: LiveCalls = backend.live_calls  # an hour on: both expire by age
    counts = live.expire(store, ttl_s=3600, max_pending=100, now=time.time() + 7200)
    assert counts["expired_unrewarded"] == 2 and counts["expired_ungrouped"] == 1
    reasons = [e["reason"] for e in read_jsonl(events_path(store)) if e["event"] == "expired"]
    assert reasons == ["count", "ttl"]


async def test_groups_form_by_task_key_and_a_batch_is_taken_once(tf_backend):
    backend, model, _ = await _online(tf_backend, "live-groups", group_size=2)
    store, live = backend.store(model), backend.live_calls
    async with _gateway(backend) as http:
        by_task = {task: [await _call(http, model, task) for _ in range(3)]
                   for task in ("a", "b")}
        for ids in by_task.values():
            for i, response_id in enumerate(ids[:2]):
                await http.post(f"/feedback/{response_id}", json={"reward": float(i)})
    assert live.ready(store, 2) == 2  # a full group per task; the third calls wait
    first = live.take(store, 5, 2, "online-0001")
    assert sorted(g[0].group for g in first) == ["task:a", "task:b"]
    assert all(len(g) == 2 and g[0].group == g[1].group for g in first)
    again = live.take(store, 5, 2, "online-0001")
    assert [[r.rollout_id for r in g] for g in again] == [[r.rollout_id for r in g]
                                                          for g in first]
    assert live.ready(store, 2) == 0 and live.counts(store)["trained"] == 4


async def test_a_group_with_equal_rewards_expires_and_makes_no_step(tf_backend):
    """DAPO's dynamic sampling online: a full group whose rewards are all equal teaches GRPO
    nothing, so its calls expire ('no_signal', counted) instead of training a candidate that
    learnt nothing; the task's later calls form a group of their own, which trains."""
    backend, model, loop = await _online(tf_backend, "live-signal", group_size=2,
                                         groups_per_step=1)
    store = backend.store(model)
    async with _gateway(backend) as http:
        flat = [await _call(http, model, "flat") for _ in range(2)]
        for response_id in flat:
            assert (await http.post(f"/feedback/{response_id}",
                                    json={"reward": 0.0})).status_code == 200
        assert await loop.tick() == "collecting"  # no group with signal: no step
        counts = loop.status()
        assert counts["expired_no_signal"] == 2 and counts["ready_groups"] == 0
        assert counts["trained_steps"] == [] and store.latest_step() == 0
        r = await http.post(f"/feedback/{flat[0]}", json={"reward": 1.0})
        assert r.status_code == 409 and "equal" in r.json()["error"]["message"]
        spread = [await _call(http, model, "flat") for _ in range(2)]
        for reward, response_id in zip((0.0, 1.0), spread, strict=True):
            await http.post(f"/feedback/{response_id}", json={"reward": reward})
    assert backend.live_calls.ready(store, 2, 1e-6) == 1
    assert await loop.tick() == "trained"
    reasons = [e["reason"] for e in read_jsonl(events_path(store)) if e["event"] == "expired"]
    assert reasons == ["no_signal"]


async def test_the_live_log_replays_past_a_torn_line_and_logs_a_recorded_call_it_missed(
        tf_backend):
    backend, model, _ = await _online(tf_backend, "live-crash")
    store = backend.store(model)
    async with _gateway(backend) as http:
        response_id = await _call(http, model)
        await http.post(f"/feedback/{response_id}", json={"reward": 0.25})
    (event, _) = read_jsonl(events_path(store))
    # a call whose record was written but not its log line (killed between the two)
    missed = store.calls_path("live-" + "f" * 32)
    record = json.loads(store.calls_path(event["rollout_id"]).read_text())
    record["rollout_id"], record["response"]["id"] = missed.stem, "chatcmpl-missed"
    missed.write_text(json.dumps(record) + "\n")
    with open(events_path(store), "ab") as f:
        f.write(b'{"event": "feedback", "respon')  # killed mid-append
    state = _ModelLive(store)
    assert state.calls[event["rollout_id"]].reward == 0.25
    assert state.by_response["chatcmpl-missed"] == missed.stem
    assert read_jsonl(events_path(store))[-1]["rollout_id"] == missed.stem


def test_a_bad_online_config_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match="group_size"):
        online_config('{"group_size": 1}')
    with pytest.raises(ConfigError, match="gates"):
        online_config({"gates": {"margn": 0.1}})


async def test_a_sessions_calls_are_one_rollout_rewarded_once_and_trained_together(tf_backend):
    backend, model, loop = await _online(tf_backend, "live-session", group_size=2)
    store, live = backend.store(model), backend.live_calls

    async def session_call(http: httpx.AsyncClient, session: str) -> str:
        tags = {"task": "colors", "session": session}
        r = await http.post("/chat/completions", headers={"x-tracerl-tags": json.dumps(tags)},
                            json={"model": model.name, "max_tokens": 2, "temperature": 0.0,
                                  "messages": [{"role": "user", "content": "Name a color."}]})
        assert r.status_code == 200, r.text
        return r.json()["id"]

    async with _gateway(backend) as http:
        episodes = {s: [await session_call(http, s) for _ in range(2)] for s in ("e1", "e2")}
        views = [(await http.get(f"/feedback/{rid}")).json() for rid in episodes["e1"]]
        assert views[0]["rollout_id"] == views[1]["rollout_id"] != (
            await http.get(f"/feedback/{episodes['e2'][0]}")).json()["rollout_id"]
        assert views[0]["rollout_id"].startswith("live-") and views[0]["task"] == "task:colors"
        assert len(await model.fetch_calls(views[0]["rollout_id"])) == 2  # one record file
        assert loop.status()["calls"] == 2  # two rollouts of two calls each
        # the reward is the rollout's: posted to its last call, final for its first too
        for i, (first, last) in enumerate(episodes.values()):
            r = await http.post(f"/feedback/{last}", json={"reward": float(i)})
            assert r.status_code == 200 and r.json()["reward"] == float(i), r.text
            r = await http.post(f"/feedback/{first}", json={"reward": 0.5})
            assert r.status_code == 409 and first in r.json()["error"]["message"]
    assert live.ready(store, 2) == 1
    (group,) = build_groups(live.take(store, 1, 2, "online-0001"), store, backend.call_store,
                            backend.rollouts)
    assert sorted(t.reward for t in group.trajectories) == [0.0, 1.0]
    assert [len(t.llm_calls) for t in group.trajectories] == [2, 2]  # trained together

    # a session's later call recorded but not logged (a crash between the two writes): logged
    # from its record at the next start, under the session's rollout
    path = store.calls_path(views[0]["rollout_id"])
    record = json.loads(path.read_text().splitlines()[-1])
    record["response"]["id"] = "chatcmpl-missed-turn"
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
    state = _ModelLive(store)
    assert state.by_response["chatcmpl-missed-turn"] == views[0]["rollout_id"]
    assert len(state.calls) == 2
