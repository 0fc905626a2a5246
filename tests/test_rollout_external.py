"""The rollout API: a service outside the trainer's process (Node here) opens rollouts on the
gateway, calls the model under them, sets rewards and finishes them; the trainer gathers the
finished groups (each rollout once) and trains on them. Orphan and late calls are counted in
the step's health."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import httpx2
import pytest

import tracerl
from tracerl.backend.rollout_log import events_path
from tracerl.backend.training.rows import RowStats, rows_from_calls
from tracerl.core.errors import RolloutTimeoutError

SERVICE = Path(__file__).with_name("external_rollout_service.cjs")
CONFIG = tracerl.ModelConfig(engine=tracerl.EngineConfig(max_model_len=256))
HI = [{"role": "user", "content": "hi"}]


def run_service(root: str, model: str, group: str, key: str | None = None) -> list[dict]:
    """The Node service: two rollouts of ``group``, rewards 0 and 1, finished."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    out = subprocess.run([node, str(SERVICE), root, model, group, *([key] if key else [])],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
async def ext(tf_backend):
    backend, _ = tf_backend
    model = tracerl.TrainableModel(name="ext", project="tests", base_model="smollm2",
                                   config=CONFIG)
    await model.register(backend)
    root = backend.base_url.removesuffix("/v1")
    async with httpx2.AsyncClient(base_url=root, timeout=120) as http:
        yield SimpleNamespace(backend=backend, model=model, root=root, http=http,
                              store=backend.store(model))


async def open_rollout(http: httpx2.AsyncClient, **body) -> dict:
    r = await http.post("/v1/rollouts", json={"model": "ext", **body})
    assert r.status_code == 200, r.text
    return r.json()


async def chat(http: httpx2.AsyncClient, opened: dict, root: str) -> httpx2.Response:
    return await http.post(opened["base_url"].removeprefix(root) + "/chat/completions",
                           json={"model": "ext", "max_tokens": 4, "messages": HI})


@pytest.fixture(scope="module")
async def steps(ext):
    """A call under a made-up rollout id, and one of a logged validation rollout; the Node
    service's group, gathered and trained (step
    1); a call for one of its rollouts after it finished; a second group opened from Python,
    trained (step 2)."""
    http, run = ext.http, SimpleNamespace()
    made_up = await http.post("/v1/chat/completions", headers={"x-rollout-id": "made-up-id"},
                              json={"model": "ext", "max_tokens": 4, "messages": HI})
    assert made_up.status_code == 200, made_up.text
    val = await http.post("/v1/chat/completions", headers={"x-rollout-id": "val-logged"},
                          json={"model": "ext", "max_tokens": 4, "messages": HI})
    assert val.status_code == 200, val.text
    await ext.model.log([tracerl.TrajectoryGroup([  # a logged (validation) rollout: no orphan
        tracerl.Trajectory(rollout_id="val-logged", reward=1.0, messages_and_choices=HI)])],
        split="val")
    run.service = await asyncio.to_thread(run_service, ext.root, "ext", "node-group")
    run.groups = await tracerl.gather_external_groups(ext.model, 1, timeout_s=60)
    run.metrics1 = await ext.model.train(run.groups, tracerl.TrainConfig(learning_rate=1e-5))
    run.late = await chat(http, {"base_url": f"{ext.root}/rollouts/"
                                             f"{run.service[0]['rollout_id']}/v1"}, ext.root)
    for reward in (0.0, 1.0):
        opened = await open_rollout(http, group="py-group", group_size=2)
        assert (await chat(http, opened, ext.root)).status_code == 200
        finished = await http.post(f"/v1/rollouts/{opened['rollout_id']}/finish",
                                   json={"reward": reward})
        assert finished.status_code == 200, finished.text
    run.groups2 = await tracerl.gather_external_groups(ext.model, 1, timeout_s=60)
    run.metrics2 = await ext.model.train(run.groups2, tracerl.TrainConfig(learning_rate=1e-5))
    return run


async def test_the_node_services_group_is_gathered_with_its_calls_and_rewards(steps, ext):
    (group,) = steps.groups
    by_id = {t.rollout_id: t for t in group.trajectories}
    assert set(by_id) == {r["rollout_id"] for r in steps.service}
    for i, r in enumerate(steps.service):
        t = by_id[r["rollout_id"]]
        (call,) = t.llm_calls
        assert (t.reward, t.metrics["chars"]) == (float(i), float(len(r["text"])))
        assert call.completions[0].text == r["text"] and call.response["id"] == r["response_id"]
        assert t.metadata == {"service": "node", "index": i, "external": True}
        assert t.messages_and_choices[0] == {"role": "user", "content": f"Say the number {i}."}


async def test_the_trained_rows_are_the_recorded_tokens(steps, ext):
    assert steps.metrics1["groups"] == 1.0 and steps.metrics1["skipped_groups"] == 0.0
    saved = tracerl.TrajectoryGroup.model_validate_json(
        ext.store.trajectories_path("train", 1).read_text().splitlines()[0])
    for t in saved.trajectories:
        (row,) = rows_from_calls(t.llm_calls, RowStats())
        (recorded,) = await ext.model.fetch_calls(t.rollout_id)
        assert row.input_ids == recorded.prompt_token_ids + recorded.completions[0].token_ids
    logged = [json.loads(line) for line in (ext.store.root / "token_logprobs" / "0001.jsonl")
              .read_text().splitlines()]
    recorded_logprobs = sorted([c.completions[0].logprobs for t in saved.trajectories
                                for c in t.llm_calls])
    assert sorted(e["engine"] for e in logged) == recorded_logprobs


async def test_a_call_after_its_rollout_finished_is_recorded_apart(steps, ext):
    assert steps.late.status_code == 200
    rid = steps.service[0]["rollout_id"]
    assert len(await ext.model.fetch_calls(rid)) == 1  # the trajectory's call only
    late = (ext.store.root / "calls" / "_late.jsonl").read_text().splitlines()
    assert [json.loads(line)["rollout_id"] for line in late] == [rid]


async def test_orphan_and_late_calls_are_in_the_steps_health(steps):
    assert (steps.metrics1["orphan_calls"], steps.metrics1["late_calls"]) == (0.0, 0.0)
    # the made-up id was unclaimed at step 1 and still at step 2: its one call is an orphan
    # (the logged validation rollout's call is not)
    assert (steps.metrics2["orphan_calls"], steps.metrics2["orphan_rollouts"],
            steps.metrics2["late_calls"]) == (1.0, 1.0, 1.0)
    from tracerl.backend.training.health import step_warnings

    items = {w.item: w for w in step_warnings(steps.metrics2)}
    assert "finish a rollout only once" in items["late_calls"].fix
    assert "POST /v1/rollouts" in items["orphan_calls"].fix


async def test_each_rollout_is_handed_out_once(steps, ext):
    with pytest.raises(RolloutTimeoutError, match=r"ready groups: 0.*handed out before: 4"):
        await tracerl.gather_external_groups(ext.model, 1, timeout_s=0.2)


async def test_a_retried_take_gets_the_same_groups(ext):
    ids = []
    for _ in range(2):
        opened = await open_rollout(ext.http, group="retried", group_size=2)
        await ext.http.post(f"/v1/rollouts/{opened['rollout_id']}/finish", json={"reward": 1})
        ids.append(opened["rollout_id"])
    first = await ext.backend.take_external_groups(ext.model, 1, "take-retried")
    again = await ext.backend.take_external_groups(ext.model, 1, "take-retried")
    other = await ext.backend.take_external_groups(ext.model, 1, "take-other")
    assert [t.rollout_id for t in first[0].trajectories] == ids
    assert [t.rollout_id for t in again[0].trajectories] == ids and other == []


INVALID = {
    "no model": ("/v1/rollouts", {}, "model"),
    "unknown model": ("/v1/rollouts", {"model": "nope"}, "model"),
    "bad group": ("/v1/rollouts", {"model": "ext", "group": "../x"}, "group"),
    "bad size": ("/v1/rollouts", {"model": "ext", "group_size": 0}, "group_size"),
    "bad metadata": ("/v1/rollouts", {"model": "ext", "metadata": [1]}, "metadata"),
    "reward not a number": ("/v1/rollouts/{id}/reward", {"reward": "high"}, "reward"),
    "reward missing": ("/v1/rollouts/{id}/reward", {}, "reward"),
    # two of them overflow their group's mean: the loss would be NaN
    "reward overflowing": ("/v1/rollouts/{id}/reward", {"reward": 1e308}, "reward"),
    "finish reward overflowing": ("/v1/rollouts/{id}/finish", {"reward": -2e6}, "reward"),
    "bad metric": ("/v1/rollouts/{id}/reward", {"reward": 1, "metrics": {"a": "x"}},
                   "metrics.a"),
    "bad status": ("/v1/rollouts/{id}/finish", {"status": "done"}, "status"),
    "bad error": ("/v1/rollouts/{id}/finish", {"status": "failed", "error": 3}, "error"),
    "bad span": ("/v1/rollouts/{id}/spans", [{"id": "s", "kind": "nope"}], "spans[0]"),
}


@pytest.mark.parametrize("case", INVALID, ids=list(INVALID))
async def test_an_invalid_body_is_a_400_naming_the_field_and_writes_nothing(ext, case):
    opened = await open_rollout(ext.http, metadata={"case": case})
    path, body, param = INVALID[case]
    before = events_path(ext.store).read_bytes()
    r = await ext.http.post(path.format(id=opened["rollout_id"]), json=body)
    assert (r.status_code, r.json()["error"]["param"]) == (400, param), r.text
    assert events_path(ext.store).read_bytes() == before
    assert not (ext.store.root / "spans" / f"{opened['rollout_id']}.jsonl").exists()


@pytest.mark.parametrize("route", ["reward", "finish"])
async def test_a_5000_digit_reward_is_a_400_naming_reward(ext, route):
    """Past Python's 4,300-digit limit the body did not parse at all, and the 400 named
    ``body``; it names the field now."""
    opened = await open_rollout(ext.http)
    before = events_path(ext.store).read_bytes()
    r = await ext.http.post(f"/v1/rollouts/{opened['rollout_id']}/{route}",
                            content=b'{"reward": ' + b"9" * 5000 + b"}",
                            headers={"content-type": "application/json"})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "reward"), r.text
    assert "outside 64 bits" in r.json()["error"]["message"]
    assert events_path(ext.store).read_bytes() == before


async def test_an_unknown_rollout_is_a_404_and_a_reward_after_finish_a_409(ext):
    missing = await ext.http.post("/v1/rollouts/ext-nope/reward", json={"reward": 1})
    assert (missing.status_code, missing.json()["error"]["code"]) == (404, "rollout_not_found")
    assert (await ext.http.get("/v1/rollouts/ext-nope")).status_code == 404
    opened = await open_rollout(ext.http)
    done = await ext.http.post(f"/v1/rollouts/{opened['rollout_id']}/finish",
                               json={"reward": 0.5, "status": "ok"})
    assert done.json()["status"] == "ok"
    for route in ("reward", "finish"):
        again = await ext.http.post(f"/v1/rollouts/{opened['rollout_id']}/{route}",
                                    json={"reward": 1})
        assert (again.status_code, again.json()["error"]["code"]) == (409, "rollout_finished")
    state = (await ext.http.get(f"/v1/rollouts/{opened['rollout_id']}")).json()
    assert (state["reward"], state["status"]) == (0.5, "ok")
    (group,) = await ext.backend.take_external_groups(ext.model, 1, "take-409")  # a group of one
    assert [(t.rollout_id, t.reward) for t in group.trajectories] == [(opened["rollout_id"], 0.5)]


async def test_a_failed_rollout_is_its_groups_exception(ext):
    ok = await open_rollout(ext.http, group="half-failed", group_size=2)
    bad = await open_rollout(ext.http, group="half-failed", group_size=2)
    await ext.http.post(f"/v1/rollouts/{ok['rollout_id']}/finish", json={"reward": 1})
    await ext.http.post(f"/v1/rollouts/{bad['rollout_id']}/finish",
                        json={"status": "failed", "error": "tool crashed"})
    (group,) = await ext.backend.take_external_groups(ext.model, 1, "take-half-failed")
    assert [t.rollout_id for t in group.trajectories] == [ok["rollout_id"]]
    assert [(e.rollout_id, e.message) for e in group.exceptions] == [
        (bad["rollout_id"], "tool crashed")]


async def test_a_restarted_backend_keeps_open_and_finished_rollouts(ext):
    model = tracerl.TrainableModel(name="ext-restart", project="tests", base_model="smollm2",
                                   config=CONFIG)
    await model.register(ext.backend)
    http = ext.http
    finished = (await http.post("/v1/rollouts", json={"model": "ext-restart"})).json()
    still_open = (await http.post("/v1/rollouts", json={"model": "ext-restart"})).json()
    await http.post(f"/v1/rollouts/{finished['rollout_id']}/finish", json={"reward": 2})
    (taken,) = await ext.backend.take_external_groups(model, 1, "take-before-restart")
    assert [t.rollout_id for t in taken.trajectories] == [finished["rollout_id"]]

    again = tracerl.LocalBackend(path=ext.backend.path, engine="transformers")
    try:
        await model.register(again)
        root = again.base_url.removesuffix("/v1")
        async with httpx2.AsyncClient(base_url=root, timeout=60) as http2:
            kept = (await http2.get(f"/v1/rollouts/{finished['rollout_id']}")).json()
            assert (kept["status"], kept["reward"], kept["handed_out"]) == ("ok", 2.0, True)
            assert (await http2.get(f"/v1/rollouts/{still_open['rollout_id']}")
                    ).json()["status"] == "open"
            r = await http2.post(f"/v1/rollouts/{still_open['rollout_id']}/finish",
                                 json={"reward": 3})
            assert r.status_code == 200, r.text
        (group,) = await tracerl.gather_external_groups(model, 1, timeout_s=10)
        assert [(t.rollout_id, t.reward) for t in group.trajectories] == [
            (still_open["rollout_id"], 3.0)]
    finally:
        await again.close()
        await model.register(ext.backend)
