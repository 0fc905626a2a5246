"""The rollout API on a real ``tracerl serve``: the Node service opens, calls and finishes its
rollouts on the server's gateway (with the server's API key), and a ``RemoteBackend`` trainer
gathers and trains the group."""

from __future__ import annotations

import asyncio

import httpx2
import pytest

import tracerl

from .remote_server import API_KEY, registered_on
from .test_rollout_external import CONFIG, run_service


@pytest.fixture(scope="module")
def server(faults_server):
    """The session's ``tracerl serve`` process (one server start less in CI)."""
    return faults_server


@pytest.fixture(scope="module")
async def remote(server):
    model = await registered_on(server.url, "ext-remote", "tests", CONFIG)
    service = await asyncio.to_thread(run_service, server.url, model.get_inference_name(),
                                      "remote-group", API_KEY)
    groups = await tracerl.gather_external_groups(model, 1, timeout_s=60)
    metrics = await model.train(groups, tracerl.TrainConfig(learning_rate=1e-5))
    yield model, service, groups, metrics
    await model.backend.close()


def test_the_rollout_api_needs_the_servers_key(server):
    r = httpx2.post(server.url + "/v1/rollouts", json={"model": "ext-remote"}, timeout=30)
    assert (r.status_code, r.json()["error"]["code"]) == (401, "invalid_api_key")


async def test_a_remote_trainer_gathers_and_trains_the_services_group(remote):
    model, service, (group,), metrics = remote
    rewards = {t.rollout_id: (t.reward, t.llm_calls[0].completions[0].text)
               for t in group.trajectories}
    assert rewards == {r["rollout_id"]: (float(i), r["text"]) for i, r in enumerate(service)}
    assert (metrics["groups"], metrics["skipped_groups"], await model.get_step()) == (1.0, 0.0, 1)


async def test_a_remote_trainer_gets_each_rollout_once(remote):
    model, *_ = remote
    with pytest.raises(tracerl.RolloutTimeoutError, match="handed out before: 2"):
        await tracerl.gather_external_groups(model, 1, timeout_s=0.2)


async def test_spans_posted_to_the_server_come_back_to_a_remote_trainer(remote, server):
    model, service, *_ = remote
    rid = service[0]["rollout_id"]
    span = {"id": "span-remote", "kind": "tool", "name": "lookup", "start_time": 1.0}
    r = httpx2.post(f"{server.url}/v1/rollouts/{rid}/spans", json=[span], timeout=30,
                    headers={"authorization": f"Bearer {API_KEY}"})
    assert r.json() == {"rollout_id": rid, "added": 1}, r.text
    (got,) = await model.fetch_spans(rid)
    assert (got.id, got.kind, got.name) == ("span-remote", "tool", "lookup")


@pytest.mark.parametrize("n_groups", [None, 0, "2", True, 1.5])
def test_a_take_without_a_whole_number_of_groups_is_a_400_naming_it(remote, server, n_groups):
    """The control API's take (what ``RemoteBackend`` calls) refuses it before anything is
    taken."""
    body = {"request_id": "take-bad-n", **({} if n_groups is None else {"n_groups": n_groups})}
    r = httpx2.post(f"{server.url}/api/v1/models/tests/ext-remote/external/take", json=body,
                    headers={"authorization": f"Bearer {API_KEY}"}, timeout=30)
    assert r.status_code == 400 and "n_groups" in r.json()["error"]["message"], r.text
