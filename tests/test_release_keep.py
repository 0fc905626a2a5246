"""What release control needs kept is kept: deleting checkpoints never deletes the release
incumbent, the candidate, or a step a move in progress names (kept, and a warning says which
and why); and a server whose model lost its incumbent's checkpoint anyway (an older version,
a hand) starts, serves its other models, says why that one is not served, and serves it again
once a promote names a checkpoint that exists -- under kill -9 and restart, through a real
``tracerl serve``."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import urllib.error
import urllib.request

import tracerl
from tests.conftest import make_random_lora
from tracerl.backend.online.release import ReleaseControl
from tracerl.core.fingerprint import adapter_digest
from tracerl.core.release_log import ReleaseLog
from tracerl.core.storage import ModelStore

from .remote_server import API_KEY, ServerProcess, registered_on

CONFIG = tracerl.ModelConfig(engine=tracerl.EngineConfig(max_model_len=256))


async def _checkpoints(smollm2_path, store: ModelStore, steps) -> None:
    for step in steps:
        await asyncio.to_thread(make_random_lora, smollm2_path, store.checkpoint_dir(step), step)


async def test_deleting_checkpoints_keeps_the_incumbent_and_the_candidate_and_says_so(
        tf_backend, smollm2_path, caplog):
    backend, _ = tf_backend
    model = tracerl.TrainableModel(name="keep", project="tests", base_model="smollm2",
                                   config=CONFIG)
    store = backend.store(model)
    await _checkpoints(smollm2_path, store, (1, 2, 3, 4, 5))
    await model.register(backend)
    control = ReleaseControl(backend, model)
    await control.promote(1)
    await control.propose(3)
    with caplog.at_level(logging.WARNING, logger="tracerl.core.release_log"):
        deleted = await model.delete_checkpoints(None)  # keeps only the newest, 5
    assert deleted == [2, 4] and store.checkpoint_steps() == [1, 3, 5]
    warning = caplog.text
    assert "kept checkpoints [1, 3]" in warning and "release incumbent" in warning
    assert "release candidate" in warning
    await control.reject(3, "test")
    assert await backend.delete_checkpoints(model, set()) == [3]
    assert store.checkpoint_steps() == [1, 5]


def _post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Authorization": f"Bearer {API_KEY}",
                                              "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _get(url: str) -> dict:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(request, timeout=60) as r:
        return json.loads(r.read())


def _call(srv: ServerProcess, model: str) -> tuple[int, dict]:
    return _post(srv.url + "/v1/chat/completions", {
        "model": model, "max_tokens": 2, "temperature": 0.0,
        "messages": [{"role": "user", "content": "Hi"}]})


async def test_a_server_whose_model_lost_its_incumbent_starts_and_serves_the_others(
        tmp_path, smollm2_path):
    store = ModelStore(tmp_path / "data", "rel", "r1")
    await _checkpoints(smollm2_path, store, (1, 2, 3, 4))
    releases = ReleaseLog(store.root)
    releases.begin("promote", 1, 0)  # promoted to 1, trained on to 4
    releases.commit("promote", 1)
    srv = ServerProcess(tmp_path).start()
    try:
        for name in ("r1", "other"):  # registered: their definitions are on the server
            await (await registered_on(srv.url, name, "rel", CONFIG)).backend.close()
        status, answer = await asyncio.to_thread(
            _post, f"{srv.url}/api/v1/models/rel/r1/checkpoints/delete", {"keep_steps": []})
        assert status == 200 and answer["deleted"] == [2, 3], answer
        assert "release incumbent" in answer["kept"]["1"]
        assert store.checkpoint_steps() == [1, 4]

        srv.kill9()
        shutil.rmtree(store.checkpoint_dir(1))  # lost anyway (an older server, a hand)
        broken = store.root.parent / "broken" / "model.json"  # and a torn definition
        broken.parent.mkdir()
        broken.write_text('{"name": "broken", "pro')
        await asyncio.to_thread(srv.start)  # starts, serves the other model
        status, answer = await asyncio.to_thread(_call, srv, "rel/other")
        assert status == 200, answer
        status, answer = await asyncio.to_thread(_call, srv, "rel/r1")
        assert status == 503 and answer["error"]["code"] == "model_unavailable", answer
        assert "no checkpoint 1" in answer["error"]["message"]
        assert "tracerl promote rel/r1" in answer["error"]["message"]
        unavailable = (await asyncio.to_thread(_get, srv.url + "/api/v1/status"))["unavailable"]
        assert sorted(unavailable) == ["rel/broken", "rel/r1"], unavailable
        assert "no checkpoint 1" in unavailable["rel/r1"]
        assert unavailable["rel/broken"].startswith(f"{broken} is not a readable model "
                                                    "definition"), unavailable
        listed = [m["id"] for m in (await asyncio.to_thread(_get, srv.url + "/v1/models"))["data"]]
        assert "rel/other" in listed and "rel/r1" not in listed
        assert "rel/r1 is not served" in srv.log.read_text()

        status, answer = await asyncio.to_thread(
            _post, f"{srv.url}/api/v1/models/rel/r1/release/promote", {"step": 4})
        assert status == 200 and answer["incumbent"] == 4, answer
        model = await registered_on(srv.url, "r1", "rel", CONFIG)
        try:
            with tracerl.rollout_scope() as ro:
                await model.openai_client().chat.completions.create(
                    model=model.get_inference_name(), max_tokens=2, temperature=0.0,
                    messages=[{"role": "user", "content": "Hi"}])
            (call,) = await model.fetch_calls(ro.rollout_id)
        finally:
            await model.backend.close()
        assert call.adapter_step == 4
        assert call.adapter_digest == adapter_digest(store.checkpoint_dir(4))
        unavailable = (await asyncio.to_thread(_get, srv.url + "/api/v1/status"))["unavailable"]
        assert list(unavailable) == ["rel/broken"]
    finally:
        srv.stop()
