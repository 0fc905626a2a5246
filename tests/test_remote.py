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
from http.client import HTTPConnection
from types import SimpleNamespace

import httpx2
import pytest

import tracerl
from tracerl.core.storage import ModelStore
from tracerl.core.trajectory import read_groups_jsonl

from .conftest import until
from .remote_server import API_KEY, ROOT, ServerProcess, free_port

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


# a short system message: SmolLM2's template adds a 15-token default one to a prompt without
# (prefill is most of a call on CPU, and the 500-call test is the suite's longest)
SYSTEM = {"role": "system", "content": "Count."}


async def _rollout(model: tracerl.Model, i: int, max_tokens: int = 4) -> tracerl.Trajectory:
    messages = [SYSTEM, {"role": "user", "content": f"Say the number {i}."}]
    r = await model.openai_client().chat.completions.create(
        model=model.name, messages=messages, max_tokens=max_tokens, temperature=1.0)
    return tracerl.Trajectory(messages_and_choices=[*messages, r.choices[0]], reward=float(i % 4))


async def served_adapter_step(model: tracerl.Model) -> int:
    """The adapter step the gateway serves ``model`` with now, read from the call's record."""
    with tracerl.rollout_scope() as ro:
        await model.openai_client().chat.completions.create(
            model=model.name, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    (call,) = await model.fetch_calls(ro.rollout_id)
    return call.adapter_step


@pytest.fixture(scope="module")
async def remote_run(server, remote_model):
    """One model's life over HTTP, each result kept for the tests below: four rollouts through
    the server's gateway, step 1, the adapter served after it, a val log, step 2, then
    checkpoint retention (with and without the best val reward) and the pending groups."""
    model = remote_model
    run = SimpleNamespace(model=model, store=ModelStore(server.path / "data", "tests", "remote"))
    config = tracerl.TrainConfig(learning_rate=1e-3)
    run.step_before = await model.get_step()
    run.groups = await tracerl.gather_trajectory_groups(
        [tracerl.TrajectoryGroup(_rollout(model, i) for i in range(4))], show_progress=False)
    run.metrics = await model.train(run.groups, config=config)
    run.step_after = await model.get_step()
    run.served_after_step_1 = await served_adapter_step(model)
    run.val = await model.log(run.groups, split="val", metrics={"accuracy": 0.5})
    run.history = await model.history()
    await model.train(run.groups, config=config)
    run.checkpoints_after_step_2 = run.store.checkpoint_steps()
    run.deleted_keeping_best = await model.delete_checkpoints(keep_last=1)
    run.deleted_keeping_newest = await model.delete_checkpoints(None, keep_last=1)
    run.checkpoints_left = run.store.checkpoint_steps()
    run.pending = await model.backend.pending_groups(model)
    return run


async def test_each_rollout_gets_its_own_token_record_from_the_servers_gateway(remote_run):
    for t in remote_run.groups[0]:
        (call,) = t.llm_calls
        assert call.rollout_id == t.rollout_id
        assert call.request["messages"] == t.messages()[:2]  # the system and user messages


async def test_the_remote_records_are_token_exact(remote_run):
    for t in remote_run.groups[0]:
        (call,) = t.llm_calls
        assert call.prompt_token_ids and call.adapter_step == 0
        assert len(call.completions[0].token_ids) == len(call.completions[0].logprobs) >= 1


async def test_a_remote_step_advances_the_model_by_one(remote_run):
    assert (remote_run.step_before, remote_run.step_after) == (0, 1)


async def test_a_remote_step_trains_the_engines_tokens(remote_run):
    assert remote_run.metrics["rows"] == 4
    assert remote_run.metrics["logprob_mismatch"] < 0.02


async def test_a_remote_step_reports_the_groups_mean_reward(remote_run):
    assert remote_run.metrics["reward"] == 1.5  # rewards 0, 1, 2, 3


async def test_the_server_saved_the_steps_trajectories_with_their_records(remote_run):
    (saved,) = read_groups_jsonl(remote_run.store.trajectories_path("train", 1))
    assert [t.rollout_id for t in saved] == [t.rollout_id for t in remote_run.groups[0]]
    assert [len(t.llm_calls[0].prompt_token_ids) for t in saved] == [
        len(t.llm_calls[0].prompt_token_ids) for t in remote_run.groups[0]]


async def test_the_new_adapter_is_served_after_a_remote_step(remote_run):
    assert remote_run.served_after_step_1 == 1


async def test_log_summarises_the_groups_beside_the_given_metrics(remote_run):
    assert (remote_run.val["reward"], remote_run.val["accuracy"]) == (1.5, 0.5)


async def test_log_writes_a_history_line_per_split(remote_run):
    assert [(h["split"], h["step"]) for h in remote_run.history] == [("train", 1), ("val", 1)]


async def test_the_val_history_line_holds_the_logged_summary(remote_run):
    val_line = remote_run.history[1]
    assert (val_line["reward"], val_line["accuracy"]) == (1.5, 0.5)


async def test_log_saves_the_logged_groups_on_the_server(remote_run):
    (group,) = read_groups_jsonl(remote_run.store.trajectories_path("val", 1))
    assert [t.rollout_id for t in group] == [t.rollout_id for t in remote_run.groups[0]]


async def test_remote_retention_keeps_the_best_val_reward_checkpoint(remote_run):
    assert remote_run.checkpoints_after_step_2 == [1, 2]
    assert remote_run.deleted_keeping_best == []  # step 1 has the best val/reward


async def test_remote_retention_without_a_metric_keeps_only_the_newest(remote_run):
    assert remote_run.deleted_keeping_newest == [1]
    assert remote_run.checkpoints_left == [2]


async def test_no_groups_are_pending_after_finished_steps(remote_run):
    assert remote_run.pending == []


async def test_the_same_name_with_another_config_is_refused(remote_model):
    same_name = tracerl.TrainableModel(name="remote", project="tests", base_model="smollm2")
    with pytest.raises(tracerl.ConfigError, match="another base model or config"):
        await same_name.register(remote_model.backend)


async def test_500_concurrent_rollout_calls_through_the_remote_gateway(remote_model):
    model = remote_model
    trajectories = await tracerl.gather_trajectories(
        (_rollout(model, i, max_tokens=1) for i in range(500)), show_progress=False)
    assert len(trajectories) == 500
    for i, t in enumerate(trajectories):
        (call,) = t.llm_calls  # exactly its own call, no other rollout's
        assert call.request["messages"][1]["content"] == f"Say the number {i}."
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
    assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_config"), r.text
    assert message in r.json()["error"]["message"]


def test_a_registration_that_is_not_json_is_refused(http):
    r = http.post("/api/v1/models", content=b"{not json", headers=AUTH)
    assert r.status_code == 400 and "not valid JSON" in r.text


def raw_get(server, path: str) -> tuple[int, str]:
    """GET ``path`` byte for byte: http.client sends dot segments as they are (httpx would
    resolve ``a/../b`` to ``b`` before the server ever saw it)."""
    conn = HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.request("GET", path, headers=AUTH)
        r = conn.getresponse()
        return r.status, r.read().decode()
    finally:
        conn.close()


LEAK = "leaked-from-outside-the-rollouts-calls"


def plant_call(path, rollout_id: str) -> None:
    """A valid call record at ``path``: a route that read this file would answer with it."""
    call = tracerl.LLMCall(id=LEAK, rollout_id=rollout_id, model="remote", request={},
                           prompt_token_ids=[1], completions=[])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(call.model_dump_json() + "\n")


MODEL_DIR = ("data", "tests", "models", "remote")
# path -> (status, the file the request would read if the path escaped; None: no file would)
ESCAPING_PATHS = {
    "encoded-slashes-in-name": ("/api/v1/models/tests/..%2F..%2Fetc/history", 404, None),
    "dot-segments-over-project-and-name": ("/api/v1/models/../../etc/history", 404, None),
    "dot-dot-as-project": ("/api/v1/models/../remote/history", 400, None),
    "dot-dot-as-model-name": ("/api/v1/models/tests/../history", 400, None),
    "encoded-slash-in-rollout-id": ("/api/v1/models/tests/remote/calls/..%2Fx", 404,
                                    (*MODEL_DIR, "x.jsonl")),
    "dot-segments-in-rollout-id": ("/api/v1/models/tests/remote/calls/../x", 404,
                                   (*MODEL_DIR, "x.jsonl")),
    "hidden-rollout-id": ("/api/v1/models/tests/remote/calls/.hidden", 400,
                          (*MODEL_DIR, "calls", ".hidden.jsonl")),
}


@pytest.mark.parametrize("case", ESCAPING_PATHS, ids=list(ESCAPING_PATHS))
def test_a_path_cannot_reach_outside_its_folder(server, remote_model, case):
    path, status, target = ESCAPING_PATHS[case]
    if target is not None:
        plant_call(server.path.joinpath(*target), rollout_id="x")
    got, text = raw_get(server, path)
    assert got == status, text
    assert LEAK not in text


def test_an_unregistered_model_is_404_with_its_code(http):
    r = http.get("/api/v1/models/tests/nobody/history", headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_registered"


TRAIN = "/api/v1/models/tests/remote/train"
GROUP_LINE = tracerl.TrajectoryGroup([tracerl.Trajectory(
    messages_and_choices=[{"role": "user", "content": "x"}], reward=1.0)]).model_dump_json() + "\n"
BIG = b'{"request_id": "r3"}\n' + b" " * (1024 * 1024 + 10)
# body, extra headers, status, error code, words of the message
BAD_UPLOADS = {
    "bad-group-line": (b'{"request_id": "r1"}\n{"trajectories": "nope"}\n', {}, 400,
                       "invalid_trajectory", "upload:2"),
    "request-id-escapes": (b'{"request_id": "../x"}\n' + GROUP_LINE.encode(), {}, 400,
                           "invalid_config", "invalid request id"),
    "bad-train-config": (b'{"request_id": "r2", "config": {"learning_rate": -1}}\n'
                         + GROUP_LINE.encode(), {}, 400, "invalid_config",
                         "invalid train config"),
    "over-the-limit": (BIG, {}, 413, "body_too_large", "over the limit"),
    # 1 KiB on the wire, over the limit once inflated
    "gzip-bomb": (gzip.compress(BIG), {"content-encoding": "gzip"}, 413, "body_too_large",
                  "decompressed"),
    "unknown-encoding": (b"x", {"content-encoding": "br"}, 400, "bad_encoding",
                         "not supported"),
}


def files_under(folder) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) if folder.exists() else []


@pytest.mark.parametrize("case", BAD_UPLOADS, ids=list(BAD_UPLOADS))
async def test_a_bad_training_upload_is_refused_naming_the_problem(http, remote_model, case):
    content, headers, status, code, message = BAD_UPLOADS[case]
    r = http.post(TRAIN, content=content, headers={**AUTH, **headers})
    assert r.status_code == status, r.text
    assert (r.json()["error"]["code"], message in r.json()["error"]["message"]) == (code, True)


@pytest.mark.parametrize("case", BAD_UPLOADS, ids=list(BAD_UPLOADS))
async def test_a_bad_training_upload_writes_nothing(http, server, remote_model, case):
    content, headers, *_ = BAD_UPLOADS[case]
    data = server.path / "data"
    before = files_under(data)
    r = http.post(TRAIN, content=content, headers={**AUTH, **headers})
    assert r.status_code >= 400
    assert files_under(data) == before


def test_a_gateway_body_over_32_mib_is_413(http):
    r = http.post("/v1/chat/completions", content=b" " * (33 * 1024 * 1024), headers=AUTH)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "body_too_large"


async def test_a_wrong_key_is_an_authentication_error(server):
    model = tracerl.TrainableModel(name="keyless", project="tests", base_model="smollm2",
                                   config=CONFIG)
    backend = tracerl.RemoteBackend(server.url, api_key="wrong")
    try:
        with pytest.raises(tracerl.AuthenticationError, match="API key"):
            await model.register(backend)
    finally:
        await backend.close()


async def test_a_server_that_never_answers_fails_after_retry_for_s():
    model = tracerl.TrainableModel(name="keyless", project="tests", base_model="smollm2",
                                   config=CONFIG)
    dead = tracerl.RemoteBackend(f"http://127.0.0.1:{free_port()}", api_key=API_KEY,
                                 retry_for_s=1.0)
    started = time.monotonic()
    try:
        with pytest.raises(tracerl.BackendUnavailableError, match="did not answer for 1 s"):
            await model.register(dead)
    finally:
        await dead.close()
    assert time.monotonic() - started < 10


def test_plain_http_to_another_machine_is_warned_about():
    with pytest.warns(UserWarning, match="plain HTTP"):
        tracerl.RemoteBackend("http://10.0.0.1:8000", api_key="k")


def test_serve_refuses_a_public_address_without_a_key(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRACERL_API_KEY"}
    out = subprocess.run([sys.executable, "-m", "tracerl", "serve", "--host", "0.0.0.0",
                          "--path", str(tmp_path)], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 2 and "needs an API key" in out.stderr


ENGINE_CONFIGS = {
    "built-in-template": (False, {"chat_template": "chatml-tools"}, None),
    "template-file": (False, {"chat_template": "/etc/passwd"}, "not a file on the server"),
    "flags-without-consent": (False, {"extra_args": ["--enforce-eager"]}, "--allow-engine-args"),
    "flags-with-consent": (True, {"extra_args": ["--enforce-eager"]}, None),
}


@pytest.mark.parametrize("case", ENGINE_CONFIGS, ids=list(ENGINE_CONFIGS))
def test_client_engine_configs_name_built_ins_and_flags_need_the_operators_consent(case):
    from tracerl.remote.server import ControlServer

    allow, engine, refusal = ENGINE_CONFIGS[case]
    config = tracerl.ModelConfig(engine=tracerl.EngineConfig(**engine))
    server = ControlServer(None, allow_engine_args=allow)
    if refusal is None:
        server.check_client_engine_config(config)  # accepted: returns without raising
    else:
        with pytest.raises(tracerl.ConfigError, match=refusal):
            server.check_client_engine_config(config)


# --- kill -9 in the middle of a training step --------------------------------------------------


async def captured(awaitable):
    """What ``awaitable`` returned, or the exception it raised."""
    try:
        return await awaitable
    except Exception as e:
        return e


@pytest.fixture(scope="module")
async def crash(tmp_path_factory):
    """A server whose step 1 stalls (tests/remote_hang_plugin.py); while it stalls, a second
    step of the model and another model's step are sent; then the server is killed with
    SIGKILL, restarted (the client's train() retries meanwhile), killed again when idle,
    restarted, and stopped with SIGTERM. What each phase showed is kept for the tests below."""
    path = tmp_path_factory.mktemp("crash")
    marker = path / "hanging"
    srv = ServerProcess(path, env={"TRACERL_TEST_HANG_MARKER": str(marker)})
    srv.start(extra_args=("--plugin", "tests.remote_hang_plugin"))
    backend = tracerl.RemoteBackend(srv.url, api_key=API_KEY, retry_for_s=240)
    model = tracerl.TrainableModel(name="crashy", project="tests", base_model="smollm2",
                                   config=CONFIG)
    other = tracerl.TrainableModel(name="queued", project="tests", base_model="smollm2",
                                   config=CONFIG)
    store = ModelStore(path / "data", "tests", "crashy")
    run = SimpleNamespace(store=store)
    try:
        await model.register(backend)
        groups = await tracerl.gather_trajectory_groups(
            [tracerl.TrajectoryGroup(_rollout(model, i) for i in range(4))], show_progress=False)
        training = asyncio.create_task(
            model.train(groups, config=tracerl.TrainConfig(learning_rate=1e-3)))
        await until(lambda: marker.exists() or training.done(),
                    "the server to hold step 1 (the hang plugin's marker file)", timeout_s=120)
        assert not training.done(), f"step 1 ended before it was held: {training.exception()!r}"

        run.second_step_meanwhile = await captured(model.train(groups))
        await other.register(backend)
        other_groups = await tracerl.gather_trajectory_groups(
            [tracerl.TrajectoryGroup(_rollout(other, i) for i in range(4))], show_progress=False)
        other_training = asyncio.create_task(other.train(other_groups))

        async def both_steps_listed():
            return len((await backend.status())["training"]) == 2

        await until(both_steps_listed, "the server to list the second model's step",
                    timeout_s=120, every_s=0.1)
        run.queue = {t["model"]: (t["state"], t["step"])
                     for t in (await backend.status())["training"]}

        srv.kill9()
        run.checkpoints_after_kill = store.checkpoint_steps()
        run.saved_after_kill = read_groups_jsonl(store.trajectories_path("train", 1))

        srv.start()  # same port, same folder, no hanging plugin; the client's train() is retrying
        run.metrics = await asyncio.wait_for(training, 300)
        run.step = await model.get_step()
        run.checkpoints = store.checkpoint_steps()
        run.train_history_steps = [h["step"] for h in store.history() if h["split"] == "train"]
        run.saved = read_groups_jsonl(store.trajectories_path("train", 1))
        run.request_markers = [json.loads(p.read_text())
                               for p in (store.root / "requests" / "train").glob("*.json")]
        run.other_metrics = await asyncio.wait_for(other_training, 300)
        run.other_step = await other.get_step()

        srv.kill9()  # an idle restart serves the last checkpoint again
        srv.start()
        run.served_after_idle_restart = await served_adapter_step(model)
        run.step_after_idle_restart = await model.get_step()
        srv.stop()  # SIGTERM: a clean stop, well within ServerProcess.stop's 30 s
        run.sigterm_returncode = srv.proc.returncode
        run.log = srv.log.read_text()
    finally:
        await backend.close()
        srv.stop()
    return run


async def test_a_second_step_of_a_training_model_is_refused_clearly(crash):
    assert isinstance(crash.second_step_meanwhile, tracerl.TrainingError)
    assert "already has training request" in str(crash.second_step_meanwhile)


async def test_another_models_step_queues_behind_the_running_one(crash):
    assert crash.queue == {"tests/crashy": ("running", 1), "tests/queued": ("queued", None)}


async def test_kill_9_mid_step_leaves_no_checkpoint(crash):
    assert crash.checkpoints_after_kill == []


async def test_the_steps_trajectories_were_saved_before_training(crash):
    (group,) = crash.saved_after_kill
    assert len(group) == 4


async def test_the_retrying_client_gets_the_steps_result_after_restart(crash):
    assert crash.metrics["rows"] == 4 and crash.step == 1


async def test_the_interrupted_step_is_trained_once(crash):
    assert crash.checkpoints == [1]
    assert crash.train_history_steps == [1]


async def test_the_interrupted_steps_trajectories_keep_their_records(crash):
    (saved,) = crash.saved
    assert len(saved) == 4
    assert [bool(t.llm_calls[0].prompt_token_ids) for t in saved] == [True] * 4


async def test_the_interrupted_request_is_marked_done(crash):
    assert [m["state"] for m in crash.request_markers] == ["done"]


async def test_the_queued_step_runs_after_the_restart(crash):
    assert crash.other_metrics["rows"] == 4 and crash.other_step == 1


async def test_an_idle_restart_serves_the_last_checkpoint(crash):
    assert (crash.served_after_idle_restart, crash.step_after_idle_restart) == (1, 1)


async def test_sigterm_stops_the_server_cleanly(crash):
    assert crash.sigterm_returncode == 0
    assert "tracerl serve: stopping" in crash.log
