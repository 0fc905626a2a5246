"""RemoteBackend against a real ``tracerl serve`` process: training, logging, retention,
500 concurrent rollout calls, security, and kill -9 in the middle of a training step."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import subprocess
import sys
import time

import httpx2
import pytest

import tracerl
from tracerl.core.storage import ModelStore
from tracerl.core.trajectory import read_groups_jsonl

from .remote_server import API_KEY, ROOT, ServerProcess

CONFIG = tracerl.ModelConfig(engine=tracerl.EngineConfig(max_model_len=256))
AUTH = {"authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("remote"), args=("--max-upload-mb", "1")).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
async def remote_model(server):
    backend = tracerl.RemoteBackend(server.url, api_key=API_KEY)
    model = tracerl.TrainableModel(
        name="remote", project="tests", base_model="smollm2", config=CONFIG
    )
    await model.register(backend)
    yield model
    await backend.close()


async def _rollout(model: tracerl.Model, i: int, max_tokens: int = 4) -> tracerl.Trajectory:
    messages = [{"role": "user", "content": f"Say the number {i}."}]
    r = await model.openai_client().chat.completions.create(
        model=model.name, messages=messages, max_tokens=max_tokens, temperature=1.0)
    return tracerl.Trajectory(messages_and_choices=[*messages, r.choices[0]], reward=float(i % 4))


async def test_train_log_history_and_retention_over_http(server, remote_model):
    model = remote_model
    assert await model.get_step() == 0
    groups = await tracerl.gather_trajectory_groups(
        [tracerl.TrajectoryGroup(_rollout(model, i) for i in range(4))], show_progress=False)
    for t in groups[0]:  # the token records come back from the server's gateway
        (call,) = t.llm_calls
        assert call.rollout_id == t.rollout_id and call.prompt_token_ids and call.adapter_step == 0
        assert len(call.completions[0].token_ids) == len(call.completions[0].logprobs) >= 1

    metrics = await model.train(groups, config=tracerl.TrainConfig(learning_rate=1e-3))
    assert await model.get_step() == 1
    assert metrics["rows"] == 4 and metrics["logprob_mismatch"] < 0.02 and metrics["reward"] == 1.5

    store = ModelStore(server.path / "data", "tests", "remote")
    (saved,) = read_groups_jsonl(store.trajectories_path("train", 1))
    assert [t.rollout_id for t in saved] == [t.rollout_id for t in groups[0]]
    assert all(t.llm_calls[0].prompt_token_ids for t in saved)

    with tracerl.rollout_scope() as ro:  # the new adapter is served
        await model.openai_client().chat.completions.create(
            model=model.name, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    (call,) = await model.fetch_calls(ro.rollout_id)
    assert call.adapter_step == 1

    val = await model.log(groups, split="val", metrics={"accuracy": 0.5})
    assert val["accuracy"] == 0.5
    history = await model.history()
    assert [(h["split"], h["step"]) for h in history] == [("train", 1), ("val", 1)]
    assert (
        history[1]["accuracy"] == 0.5
        and len(read_groups_jsonl(store.trajectories_path("val", 1))) == 1
    )

    await model.train(groups, config=tracerl.TrainConfig(learning_rate=1e-3))
    assert await model.delete_checkpoints(keep_last=1) == []  # step 1 has the best val/reward
    assert await model.delete_checkpoints(None, keep_last=1) == [1]
    assert store.checkpoint_steps() == [2]
    assert await model.backend.pending_groups(model) == []

    same_name = tracerl.TrainableModel(name="remote", project="tests", base_model="smollm2")
    with pytest.raises(tracerl.ConfigError, match="another base model or config"):
        await same_name.register(model.backend)


async def test_500_concurrent_rollout_calls_through_the_remote_gateway(remote_model):
    model = remote_model
    trajectories = await tracerl.gather_trajectories(
        (_rollout(model, i, max_tokens=1) for i in range(500)), show_progress=False)
    assert len(trajectories) == 500
    for i, t in enumerate(trajectories):
        (call,) = t.llm_calls  # exactly its own call, no other rollout's
        assert call.request["messages"][0]["content"] == f"Say the number {i}."
        assert call.rollout_id == t.rollout_id


@pytest.fixture(scope="module")
def http(server):
    with httpx2.Client(base_url=server.url, timeout=30) as client:
        yield client


def test_health_answers_without_a_key_and_tells_nothing_about_models(http):
    assert http.get("/health").json() == {"status": "ok"}


ROUTES = [("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("GET", "/api/v1/status"),
          ("POST", "/api/v1/models"), ("GET", "/api/v1/models/tests/remote/history")]
BAD_KEYS = {"none": {}, "wrong": {"authorization": "Bearer wrong"},
            "not-bearer": {"authorization": API_KEY}}


@pytest.mark.parametrize("key", BAD_KEYS, ids=list(BAD_KEYS))
@pytest.mark.parametrize(("method", "path"), ROUTES, ids=[f"{m} {p}" for m, p in ROUTES])
def test_every_route_refuses_a_missing_or_wrong_key(http, method, path, key):
    r = http.request(method, path, headers=BAD_KEYS[key])
    assert r.status_code == 401, r.text
    assert r.json()["error"]["code"] == "invalid_api_key"


def _definition(**changes):
    return {"name": "ok", "project": "tests", "base_model": "smollm2", **changes}


BAD_REGISTRATIONS = {
    "name-escapes": (_definition(name="../evil"), "invalid model name"),
    "project-has-slash": (_definition(project="a/b"), "invalid project name"),
    "base-model-is-a-path": (_definition(base_model="/etc"), "not offered by this server"),
    "bad-lora-rank": (_definition(config={"lora": {"r": -1}}), "config.lora.r"),
    "unknown-field": (_definition(shell="rm"), "unknown model definition fields"),
    "template-is-a-server-file": (
        _definition(config={"engine": {"chat_template": "/etc/passwd"}}),
        "not a file on the server"),
    "vllm-flags-naming-paths": (
        _definition(config={"engine": {"extra_args": ["--chat-template", "/etc/passwd"]}}),
        "--allow-engine-args"),
}


@pytest.mark.parametrize("case", BAD_REGISTRATIONS, ids=list(BAD_REGISTRATIONS))
def test_a_bad_registration_is_refused_naming_the_problem(http, case):
    body, message = BAD_REGISTRATIONS[case]
    r = http.post("/api/v1/models", json=body, headers=AUTH)
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]


def test_a_registration_that_is_not_json_is_refused(http):
    r = http.post("/api/v1/models", content=b"{not json", headers=AUTH)
    assert r.status_code == 400 and "not valid JSON" in r.text


ESCAPING_PATHS = {
    "encoded-slashes-in-name": ("/api/v1/models/tests/..%2F..%2Fetc/history", 404),
    "dot-segments": ("/api/v1/models/../../etc/history", 404),
    "encoded-slash-in-rollout-id": ("/api/v1/models/tests/remote/calls/..%2Fx", 404),
    "hidden-rollout-id": ("/api/v1/models/tests/remote/calls/.hidden", 400),
}


@pytest.mark.parametrize("case", ESCAPING_PATHS, ids=list(ESCAPING_PATHS))
def test_a_path_cannot_reach_outside_the_data_folder(http, server, case):
    path, status = ESCAPING_PATHS[case]
    r = http.get(path, headers=AUTH)
    assert r.status_code == status, r.text
    assert list((server.path / "data").glob("**/etc*")) == []
    assert not (server.path / "etc").exists()


def test_an_unregistered_model_is_404_with_its_code(http):
    r = http.get("/api/v1/models/tests/nobody/history", headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_registered"


TRAIN = "/api/v1/models/tests/remote/train"
_BIG = b'{"request_id": "r3"}\n' + b" " * (1024 * 1024 + 10)
BAD_UPLOADS = {
    "bad-group-line": (b'{"request_id": "r1"}\n{"trajectories": "nope"}\n', {}, 400,
                       "upload:2"),
    "request-id-escapes": (b'{"request_id": "../x"}\n', {}, 400, "invalid request id"),
    "bad-train-config": (b'{"request_id": "r2", "config": {"learning_rate": -1}}\n', {}, 400,
                         "invalid train config"),
    "over-the-limit": (_BIG, {}, 413, "over the limit"),
    # 1 KiB on the wire, over the limit once inflated
    "gzip-bomb": (gzip.compress(_BIG), {"content-encoding": "gzip"}, 413, "decompressed"),
    "unknown-encoding": (b"x", {"content-encoding": "br"}, 400, "not supported"),
}


@pytest.mark.parametrize("case", BAD_UPLOADS, ids=list(BAD_UPLOADS))
async def test_a_bad_training_upload_is_refused_before_anything_is_written(
        http, server, remote_model, case):
    content, headers, status, message = BAD_UPLOADS[case]
    if content.endswith(b"\n") and b"trajectories" not in content and status == 400:
        content += _group_line()  # a valid group after the bad parameters line
    requests = server.path / "data" / "tests" / "models" / "remote" / "requests" / "train"
    before = sorted(requests.glob("*.json")) if requests.exists() else []
    r = http.post(TRAIN, content=content, headers={**AUTH, **headers})
    assert r.status_code == status, r.text
    assert message in r.json()["error"]["message"]
    assert (sorted(requests.glob("*.json")) if requests.exists() else []) == before


def test_a_gateway_body_over_32_mib_is_413(http):
    r = http.post("/v1/chat/completions", content=b" " * (33 * 1024 * 1024), headers=AUTH)
    assert r.status_code == 413


def _group_line() -> bytes:
    t = tracerl.Trajectory(messages_and_choices=[{"role": "user", "content": "x"}], reward=1.0)
    return tracerl.TrajectoryGroup([t]).model_dump_json().encode() + b"\n"


async def test_client_errors_are_clear_and_never_hang(server):
    model = tracerl.TrainableModel(
        name="keyless", project="tests", base_model="smollm2", config=CONFIG
    )
    with pytest.raises(tracerl.AuthenticationError, match="API key"):
        await model.register(tracerl.RemoteBackend(server.url, api_key="wrong"))
    started = time.monotonic()
    dead = tracerl.RemoteBackend("http://127.0.0.1:9", api_key=API_KEY, retry_for_s=1.0)
    with pytest.raises(tracerl.BackendUnavailableError, match="did not answer for 1 s"):
        await model.register(dead)
    assert time.monotonic() - started < 10
    with pytest.warns(UserWarning, match="plain HTTP"):
        tracerl.RemoteBackend("http://10.0.0.1:8000", api_key="k")


def test_serve_refuses_a_public_address_without_a_key(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRACERL_API_KEY"}
    out = subprocess.run([sys.executable, "-m", "tracerl", "serve", "--host", "0.0.0.0",
                          "--path", str(tmp_path)], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 2 and "needs an API key" in out.stderr


async def test_kill_9_mid_step_then_restart_loses_nothing(tmp_path):
    marker = tmp_path / "hanging"
    srv = ServerProcess(tmp_path, env={"TRACERL_TEST_HANG_MARKER": str(marker)})
    srv.start(extra_args=("--plugin", "tests.remote_hang_plugin"))
    backend = tracerl.RemoteBackend(srv.url, api_key=API_KEY, retry_for_s=240)
    model = tracerl.TrainableModel(
        name="crashy", project="tests", base_model="smollm2", config=CONFIG
    )
    try:
        await model.register(backend)
        groups = await tracerl.gather_trajectory_groups(
            [tracerl.TrajectoryGroup(_rollout(model, i) for i in range(4))], show_progress=False)
        training = asyncio.create_task(
            model.train(groups, config=tracerl.TrainConfig(learning_rate=1e-3))
        )
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert time.monotonic() < deadline and not training.done(), "step 1 never started"
            await asyncio.sleep(0.2)

        # while step 1 runs: the server still answers, a second step of the model is refused
        # clearly, and another model's step queues behind it
        with pytest.raises(tracerl.TrainingError, match="already has training request"):
            await model.train(groups)
        other = tracerl.TrainableModel(
            name="queued", project="tests", base_model="smollm2", config=CONFIG
        )
        await other.register(backend)
        other_groups = await tracerl.gather_trajectory_groups(
            [tracerl.TrajectoryGroup(_rollout(other, i) for i in range(4))], show_progress=False)
        other_training = asyncio.create_task(other.train(other_groups))
        deadline = time.monotonic() + 120
        while len((await backend.status())["training"]) < 2:
            assert time.monotonic() < deadline, "the second model's step was never queued"
            await asyncio.sleep(0.2)
        states = {t["model"]: (t["state"], t["step"]) for t in (await backend.status())["training"]}
        assert states == {"tests/crashy": ("running", 1), "tests/queued": ("queued", None)}

        srv.kill9()
        store = ModelStore(tmp_path / "data", "tests", "crashy")
        assert store.checkpoint_steps() == []
        assert len(read_groups_jsonl(store.trajectories_path("train", 1))[0]) == 4  # saved first

        srv.start()  # same port, same folder, no hanging plugin; the client's train() is retrying
        metrics = await asyncio.wait_for(training, 300)
        assert metrics["rows"] == 4 and await model.get_step() == 1
        assert store.checkpoint_steps() == [1]
        assert [h["step"] for h in store.history() if h["split"] == "train"] == [1]
        (saved,) = read_groups_jsonl(store.trajectories_path("train", 1))
        assert len(saved) == 4 and all(t.llm_calls[0].prompt_token_ids for t in saved)
        (request,) = (store.root / "requests" / "train").glob("*.json")
        assert json.loads(request.read_text())["state"] == "done"

        other_metrics = await asyncio.wait_for(other_training, 300)  # the queued step ran after
        assert other_metrics["rows"] == 4 and await other.get_step() == 1

        srv.kill9()  # an idle restart serves the last checkpoint again
        srv.start()
        with tracerl.rollout_scope() as ro:
            await model.openai_client().chat.completions.create(
                model=model.name, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
        (call,) = await model.fetch_calls(ro.rollout_id)
        assert call.adapter_step == 1 and await model.get_step() == 1
        srv.stop()  # SIGTERM: a clean stop, well within the fixture's 30 s
        assert srv.proc.returncode == 0 and "tracerl serve: stopping" in srv.log.read_text()
    finally:
        await backend.close()
        srv.stop()


def test_client_engine_configs_name_built_ins_and_flags_need_the_operators_consent():
    from tracerl.remote.server import ControlServer

    built_in = tracerl.ModelConfig(engine=tracerl.EngineConfig(chat_template="chatml-tools"))
    flags = tracerl.ModelConfig(engine=tracerl.EngineConfig(extra_args=["--enforce-eager"]))
    strict, trusting = ControlServer(None), ControlServer(None, allow_engine_args=True)
    strict.check_client_engine_config(built_in)
    trusting.check_client_engine_config(flags)
    with pytest.raises(tracerl.ConfigError, match="--allow-engine-args"):
        strict.check_client_engine_config(flags)
