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
    model = tracerl.TrainableModel(name="remote", project="tests", base_model="smollm2", config=CONFIG)
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
    assert history[1]["accuracy"] == 0.5 and len(read_groups_jsonl(store.trajectories_path("val", 1))) == 1

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


def test_requests_without_the_key_or_with_bad_input_are_rejected(server):
    url = server.url
    with httpx2.Client(base_url=url, timeout=30) as http:
        assert http.get("/health").json() == {"status": "ok"}  # nothing about models
        for method, path in [("GET", "/v1/models"), ("POST", "/v1/chat/completions"),
                             ("GET", "/api/v1/status"), ("POST", "/api/v1/models"),
                             ("GET", "/api/v1/models/tests/remote/history")]:
            for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": API_KEY}):
                r = http.request(method, path, headers=headers)
                assert r.status_code == 401, (method, path, headers, r.text)
                assert r.json()["error"]["code"] == "invalid_api_key"

        def post(path, **kw):
            return http.post(path, headers={**AUTH, **kw.pop("headers", {})}, **kw)

        bad_registrations = [
            ({"name": "../evil", "project": "tests", "base_model": "smollm2"}, "invalid model name"),
            ({"name": "ok", "project": "a/b", "base_model": "smollm2"}, "invalid project name"),
            ({"name": "ok", "project": "tests", "base_model": "/etc"}, "not offered by this server"),
            ({"name": "ok", "project": "tests", "base_model": "smollm2", "config": {"lora": {"r": -1}}},
             "config.lora.r"),
            ({"name": "ok", "project": "tests", "base_model": "smollm2", "shell": "rm"},
             "unknown model definition fields"),
            ({"name": "ok", "project": "tests", "base_model": "smollm2",
              "config": {"engine": {"chat_template": "/etc/passwd"}}}, "not a file on the server"),
            ({"name": "ok", "project": "tests", "base_model": "smollm2",
              "config": {"engine": {"extra_args": ["--chat-template", "/etc/passwd"]}}}, "--allow-engine-args"),
        ]
        for body, message in bad_registrations:
            r = post("/api/v1/models", json=body)
            assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
        r = post("/api/v1/models", content=b"{not json")
        assert r.status_code == 400 and "not valid JSON" in r.text

        for path in ["/api/v1/models/tests/..%2F..%2Fetc/history", "/api/v1/models/../../etc/history",
                     "/api/v1/models/tests/remote/calls/..%2Fx", "/api/v1/models/tests/remote/calls/.hidden"]:
            r = http.get(path, headers=AUTH)
            assert r.status_code in (400, 404), (path, r.text)
        assert not list((server.path / "data").glob("**/etc*")) and not (server.path / "etc").exists()

        r = http.get("/api/v1/models/tests/nobody/history", headers=AUTH)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_registered"

        train = "/api/v1/models/tests/remote/train"
        r = post(train, content=b'{"request_id": "r1"}\n{"trajectories": "nope"}\n')
        assert r.status_code == 400 and "upload:2" in r.json()["error"]["message"]
        r = post(train, content=b'{"request_id": "../x"}\n' + _group_line())
        assert r.status_code == 400 and "invalid request id" in r.text
        r = post(train, content=b'{"request_id": "r2", "config": {"learning_rate": -1}}\n' + _group_line())
        assert r.status_code == 400 and "invalid train config" in r.text
        big = b'{"request_id": "r3"}\n' + b" " * (1024 * 1024 + 10)
        assert post(train, content=big).status_code == 413
        bomb = gzip.compress(big)  # 1 KiB on the wire, over the limit once inflated
        r = post(train, content=bomb, headers={"content-encoding": "gzip"})
        assert r.status_code == 413 and "decompressed" in r.text
        r = post(train, content=b"x", headers={"content-encoding": "br"})
        assert r.status_code == 400 and "not supported" in r.text
        r = post("/v1/chat/completions", content=b" " * (33 * 1024 * 1024))
        assert r.status_code == 413


def _group_line() -> bytes:
    t = tracerl.Trajectory(messages_and_choices=[{"role": "user", "content": "x"}], reward=1.0)
    return tracerl.TrajectoryGroup([t]).model_dump_json().encode() + b"\n"


async def test_client_errors_are_clear_and_never_hang(server):
    model = tracerl.TrainableModel(name="keyless", project="tests", base_model="smollm2", config=CONFIG)
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
    model = tracerl.TrainableModel(name="crashy", project="tests", base_model="smollm2", config=CONFIG)
    try:
        await model.register(backend)
        groups = await tracerl.gather_trajectory_groups(
            [tracerl.TrajectoryGroup(_rollout(model, i) for i in range(4))], show_progress=False)
        training = asyncio.create_task(model.train(groups, config=tracerl.TrainConfig(learning_rate=1e-3)))
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert time.monotonic() < deadline and not training.done(), "step 1 never started"
            await asyncio.sleep(0.2)

        # while step 1 runs: the server still answers, a second step of the model is refused
        # clearly, and another model's step queues behind it
        with pytest.raises(tracerl.TrainingError, match="already has training request"):
            await model.train(groups)
        other = tracerl.TrainableModel(name="queued", project="tests", base_model="smollm2", config=CONFIG)
        await other.register(backend)
        other_groups = await tracerl.gather_trajectory_groups(
            [tracerl.TrajectoryGroup(_rollout(other, i) for i in range(4))], show_progress=False)
        other_training = asyncio.create_task(other.train(other_groups))
        while len((await backend.status())["training"]) < 2:
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
    strict._check_client_engine_config(built_in)
    trusting._check_client_engine_config(flags)
    with pytest.raises(tracerl.ConfigError, match="--allow-engine-args"):
        strict._check_client_engine_config(flags)
