"""Training rows from outside, checked against the model before anything is queued or written:
token ids beyond the vocabulary or negative, ids and logprobs that disagree in length, a call
longer than the model's context. Through a real ``tracerl serve`` (the train route answers 400
naming the row) and through a ``LocalBackend`` (``model.train`` raises
:class:`InvalidTrajectoryError`); before, such a step was accepted and ended in an
``IndexError`` while training."""

from __future__ import annotations

import json
import uuid

import httpx2
import pytest

import tracerl
from tests.remote_server import API_KEY
from tests.test_faults_gateway_input import AUTH, files_of
from tests.test_training_step import _rollouts
from tracerl.core.errors import StepsFailedError
from tracerl.remote.wire import encode_groups

VOCAB = 49152  # SmolLM2's embedding rows
CONTEXT = 256  # max_model_len of the served models (faults server and tf_backend)
MODEL = "rows"


def call(prompt: list[int], completion: list[int]) -> tracerl.LLMCall:
    """A call record as the gateway writes it; ids are checked against no model here (a
    negative completion id is refused by the record itself, a negative prompt id is not)."""
    return tracerl.LLMCall(
        id="c-" + uuid.uuid4().hex[:8], prompt_token_ids=prompt,
        completions=[tracerl.CompletionRecord.model_construct(
            index=0, token_ids=completion, logprobs=[-0.5] * len(completion), text="x",
            finish_reason="stop", tool_calls=None)])


def group_with(bad: tracerl.Trajectory) -> tracerl.TrajectoryGroup:
    """A trainable group (two rewards) whose second trajectory is ``bad``."""
    good = tracerl.Trajectory(llm_calls=[call([1, 2, 3], [4, 5])], reward=1.0,
                              messages_and_choices=[{"role": "user", "content": "x"}])
    return tracerl.TrajectoryGroup([good, bad])


def with_calls(*calls: tracerl.LLMCall) -> tracerl.Trajectory:
    return tracerl.Trajectory(llm_calls=list(calls), reward=0.0,
                              messages_and_choices=[{"role": "user", "content": "x"}])


def choice_with_ids(ids: list[int]) -> tracerl.Trajectory:
    """A trajectory without token records whose choice carries the engine's token ids."""
    choice = {"index": 0, "finish_reason": "stop", "token_ids": ids,
              "message": {"role": "assistant", "content": "x"}}
    return tracerl.Trajectory(reward=0.0, messages_and_choices=[
        {"role": "user", "content": "x"}, choice])


# id: (the bad trajectory, words the error names)
BAD_ROWS = {
    "completion-id-beyond-vocab": (with_calls(call([1, 2], [10**6])),
                                   "trajectories[1].llm_calls[0].completions[0].token_ids[0]"),
    "completion-id-at-vocab": (with_calls(call([1, 2], [7, VOCAB])),
                               "trajectories[1].llm_calls[0].completions[0].token_ids[1]"),
    "prompt-id-beyond-vocab": (with_calls(call([1, VOCAB + 5], [7])),
                               "trajectories[1].llm_calls[0].prompt_token_ids[1]"),
    "negative-prompt-id": (with_calls(call([-1, 2], [7])),
                           "trajectories[1].llm_calls[0].prompt_token_ids[0]"),
    "second-call-bad": (with_calls(call([1], [2]), call([1, 2, 3], [2**40])),
                        "trajectories[1].llm_calls[1].completions[0].token_ids[0]"),
    "longer-than-context": (with_calls(call([5] * CONTEXT, [7, 8])),
                            "trajectories[1].llm_calls[0]"),
    "choice-ids-beyond-vocab": (choice_with_ids([3, VOCAB * 2]),
                                "trajectories[1].messages_and_choices[1].token_ids[1]"),
}


@pytest.fixture(scope="module")
async def rows_model(faults_server):
    backend = tracerl.RemoteBackend(faults_server.url, api_key=API_KEY)
    model = tracerl.TrainableModel(name=MODEL, project="fi", base_model="smollm2",
                                   config=tracerl.ModelConfig(
                                       engine=tracerl.EngineConfig(max_model_len=CONTEXT)))
    await model.register(backend)
    yield model
    await backend.close()


@pytest.mark.parametrize("bad, names", BAD_ROWS.values(), ids=list(BAD_ROWS))
def test_the_train_route_refuses_rows_the_model_cannot_hold_and_writes_nothing(
        faults_server, rows_model, bad, names):
    data = faults_server.path / "data"
    before = files_of(data)
    upload = encode_groups({"request_id": "rows-" + uuid.uuid4().hex[:8], "config": {}},
                           [group_with(bad)])
    with httpx2.Client(base_url=faults_server.url, headers=AUTH, timeout=120) as http:
        step = http.get(f"/api/v1/models/fi/{MODEL}").json()["step"]
        r = http.post(f"/api/v1/models/fi/{MODEL}/train", content=upload)
        status = http.get("/api/v1/status").json()
    assert r.status_code == 400, r.text[:500]
    error = r.json()["error"]
    assert error["code"] == "invalid_trajectory" and names in error["message"], error
    assert "groups[0]" in error["message"], error
    assert files_of(data) == before
    assert status["models"][f"fi/{MODEL}"] == step  # no step was taken
    assert status["training"] == [], status  # nothing queued or running


def test_ids_and_logprobs_of_different_lengths_are_refused_naming_the_row(faults_server,
                                                                        rows_model):
    """Records built in Python cannot disagree (the record refuses it); an upload can."""
    data = faults_server.path / "data"
    before = files_of(data)
    line = group_with(with_calls(call([1, 2], [7, 8, 9]))).model_dump_json()
    line = line.replace("[-0.5,-0.5,-0.5]", "[-0.5]")
    upload = json.dumps({"request_id": "lp-" + uuid.uuid4().hex[:8]}) + "\n" + line + "\n"
    with httpx2.Client(base_url=faults_server.url, headers=AUTH, timeout=120) as http:
        r = http.post(f"/api/v1/models/fi/{MODEL}/train", content=upload.encode())
    assert r.status_code == 400, r.text[:500]
    assert "3 token ids but 1 logprobs" in r.json()["error"]["message"]
    assert files_of(data) == before


@pytest.mark.parametrize("bad, names", BAD_ROWS.values(), ids=list(BAD_ROWS))
async def test_local_train_refuses_rows_the_model_cannot_hold_before_writing(tf_backend, bad,
                                                                            names):
    backend, model = tf_backend
    root = backend.store(model).root
    before, step = files_of(root), await model.get_step()
    with pytest.raises(tracerl.InvalidTrajectoryError) as e:
        await model.train([group_with(bad)], config=tracerl.TrainConfig(learning_rate=1e-5))
    assert names in str(e.value) and "groups[0]" in str(e.value)
    assert files_of(root) == before and await model.get_step() == step


def test_a_row_that_fits_is_still_trained(faults_server, rows_model):
    """The check refuses only what cannot be trained: ids just inside the vocabulary, a call
    exactly as long as the context, and a valid group train one step."""
    fits = with_calls(call([0] * (CONTEXT - 2), [VOCAB - 1, 7]))
    upload = encode_groups({"request_id": "fits-" + uuid.uuid4().hex[:8], "config": {}},
                           [group_with(fits)])
    with httpx2.Client(base_url=faults_server.url, headers=AUTH, timeout=600) as http, \
            http.stream("POST", f"/api/v1/models/fi/{MODEL}/train", content=upload) as r:
        assert r.status_code == 200
        events = [json.loads(line) for line in r.iter_lines() if line.strip()]
    assert events[-1]["event"] == "done", events[-1]


def _files_of_b(server) -> dict[str, int]:
    return {k: v for k, v in files_of(server.path / "data").items() if "many-b" in k}


async def _bad_reward_groups(model: tracerl.TrainableModel) -> list[tracerl.TrajectoryGroup]:
    groups = await _rollouts(model, [0.0, 1.0])
    groups[0].trajectories[1].reward = 1e308  # finite, but its group's variance overflows
    return groups


async def test_remote_train_many_checks_every_model_first_and_trains_the_healthy_one(
        faults_server):
    """Through a real ``tracerl serve``: model B's rows are refused before A trains (naming B
    and the field); A trains once and its result comes back with the error; B writes
    nothing. Before, A trained, then B's 400 was raised and A's result lost."""
    backend = tracerl.RemoteBackend(faults_server.url, api_key=API_KEY)
    a, b = (tracerl.TrainableModel(name=f"many-{x}", project="fi", base_model="smollm2",
                                   config=tracerl.ModelConfig(engine=tracerl.EngineConfig(
                                       max_model_len=CONTEXT))) for x in "ab")
    try:
        for m in (a, b):
            await m.register(backend)
        steps = {m: await m.get_step() for m in (a, b)}
        groups = {a: await _rollouts(a, [0.0, 1.0]), b: await _bad_reward_groups(b)}
        before_b = _files_of_b(faults_server)
        with pytest.raises(StepsFailedError) as failed:
            await backend.train_many(groups, config=tracerl.TrainConfig(learning_rate=1e-3))
        (key,) = failed.value.failed
        error = failed.value.failed[key]
        assert key == "fi/many-b" and isinstance(error, tracerl.InvalidTrajectoryError)
        assert "fi/many-b" in str(error) and "trajectories[1].reward" in str(error), error
        assert failed.value.results[a].step == steps[a] + 1  # A's result is not lost
        assert await a.get_step() == steps[a] + 1 and await b.get_step() == steps[b]
        assert _files_of_b(faults_server) == before_b
    finally:
        await backend.close()
