"""ART's checkpoint sync to object storage (``backend._experimental_push_to_s3`` /
``_experimental_pull_from_s3``) against a real S3-compatible server process (moto's server
mode), and ART's deployment names (``art.utils.deployment``)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

import tracerl
from tests.remote_server import free_port
from tracerl.backend.object_sync import model_url, pull, push
from tracerl.core.storage import ModelStore

BUCKET = "tracerl-sync"
AWS_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="module")
def s3_endpoint():
    """A moto S3 server in its own process; the AWS variables point every client at it (as a
    user's environment would point them at S3)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1",
                             "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, f"moto server exited: {proc.stderr.read().decode()[-2000:]}"
        try:
            httpx.get(url, timeout=2)
            break
        except httpx.TransportError:
            assert time.monotonic() < deadline, "waited 60 s for moto's S3 server to answer"
            time.sleep(0.1)
    saved = {k: os.environ.get(k) for k in (*AWS_ENV, "AWS_ENDPOINT_URL")}
    os.environ.update({**AWS_ENV, "AWS_ENDPOINT_URL": url})
    yield url
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    proc.kill()
    proc.wait(timeout=30)


def _fake_model(root: Path, project: str, name: str, steps: list[int]) -> ModelStore:
    """A model folder as a backend leaves it (checkpoints, history, records, temp files)."""
    store = ModelStore(root, project, name)
    for step in steps:
        ckpt = store.checkpoint_dir(step)
        ckpt.mkdir(parents=True)
        (ckpt / "adapter_model.safetensors").write_bytes(bytes([step]) * 1000)
        (ckpt / "adapter_config.json").write_text(json.dumps({"r": 8}))
        store.log_history(step, "train", {"loss": float(step)})
    store.trajectories_path("train", steps[-1]).parent.mkdir(parents=True)
    store.trajectories_path("train", steps[-1]).write_text("{}\n")
    (store.checkpoints_dir / ".0009.abc.tmp").mkdir()  # a save cut short: never copied
    (store.checkpoints_dir / ".0009.abc.tmp" / "adapter_model.safetensors").write_bytes(b"x")
    return store


def test_a_pull_into_a_fresh_folder_brings_every_checkpoint_and_the_history(
        s3_endpoint, tmp_path):
    source = _fake_model(tmp_path / "a", "sync", "m1", [1, 2, 3])
    url = model_url(source, bucket=BUCKET, prefix="runs")
    assert url == f"s3://{BUCKET}/runs/sync/models/m1"
    pushed = push(source, url)
    assert not any(".tmp" in p for p in pushed.copied)
    # a second push copies no checkpoint again (written once), only the mutable files
    again = push(source, url)
    assert all(p.startswith("checkpoints/") for p in again.skipped) and len(again.skipped) == 6

    target = ModelStore(tmp_path / "b", "sync", "m1")
    pull(target, url)
    assert target.checkpoint_steps() == [1, 2, 3] and target.latest_step() == 3
    assert [h["step"] for h in target.history()] == [1, 2, 3]
    assert (target.checkpoint_dir(2) / "adapter_model.safetensors").read_bytes() == b"\x02" * 1000
    assert not list(target.checkpoints_dir.glob(".*"))


def test_a_pull_of_the_latest_step_only_and_excluded_parts(s3_endpoint, tmp_path):
    source = _fake_model(tmp_path / "a", "sync", "m2", [1, 4])
    url = model_url(source, bucket=BUCKET)
    push(source, url)
    target = ModelStore(tmp_path / "b", "sync", "m2")
    pull(target, url, only_step="latest", exclude=["trajectories"])
    assert target.checkpoint_steps() == [4]
    assert not (target.root / "trajectories").exists()
    with pytest.raises(tracerl.ConfigError, match=r"only_step: .* no checkpoint 7"):
        pull(target, url, only_step=7)
    with pytest.raises(tracerl.ConfigError, match="exclude: unknown parts"):
        pull(target, url, exclude=["weights"])


def test_delete_makes_the_other_side_an_exact_copy(s3_endpoint, tmp_path):
    source = _fake_model(tmp_path / "a", "sync", "m3", [1, 2])
    url = model_url(source, bucket=BUCKET)
    push(source, url)
    target = ModelStore(tmp_path / "b", "sync", "m3")
    pull(target, url)
    source.delete_checkpoints(keep={2})
    push(source, url, delete=True)
    pull(target, url, delete=True)
    assert target.checkpoint_steps() == [2]
    assert not target.checkpoint_dir(1).exists()  # the checkpoint went whole


def test_no_bucket_a_missing_bucket_and_nothing_to_push_are_errors_naming_what_is_missing(
        s3_endpoint, tmp_path, monkeypatch):
    store = ModelStore(tmp_path, "sync", "absent")
    monkeypatch.delenv("BACKUP_BUCKET", raising=False)
    with pytest.raises(tracerl.ConfigError, match=r"s3_bucket: .*BACKUP_BUCKET"):
        model_url(store)
    monkeypatch.setenv("BACKUP_BUCKET", "tracerl-no-such-bucket")
    with pytest.raises(tracerl.ConfigError, match="s3_bucket: bucket 'tracerl-no-such-bucket'"):
        pull(store, model_url(store))
    with pytest.raises(tracerl.ConfigError, match="nothing to push"):
        push(store, model_url(store))
    assert not store.root.exists()  # nothing written by a refused call


def test_an_empty_bucket_or_prefix_pulls_nothing_and_says_so(s3_endpoint, tmp_path, caplog):
    """As ART's ``aws s3 sync``: nothing there, nothing copied, no error (before: "nothing to
    pull" raised, so ART's 2048 example could not start a fresh model)."""
    import fsspec

    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    fs.mkdir("tracerl-empty")
    store = ModelStore(tmp_path, "sync", "fresh")
    for url in ("s3://tracerl-empty/sync/models/fresh",
                model_url(store, bucket="tracerl-empty", prefix="runs")):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="tracerl"):
            result = pull(store, url)
        assert result.copied == [] and result.deleted == []
        assert f"nothing to pull: no objects under {url}" in caplog.text
    assert not store.root.exists()


async def test_a_fresh_model_pulls_from_an_empty_bucket_and_starts_at_step_0(
        s3_endpoint, tf_backend, monkeypatch):
    """ART's 2048 example with ``BACKUP_BUCKET`` set to an empty bucket: register, pull, go on."""
    import fsspec

    fsspec.filesystem("s3", skip_instance_cache=True).mkdir("tracerl-empty-2048")
    monkeypatch.setenv("BACKUP_BUCKET", "tracerl-empty-2048")
    backend, _ = tf_backend
    model = tracerl.TrainableModel(name="fresh-2048", project="sync", base_model="smollm2",
                                   config=tracerl.ModelConfig(
                                       engine=tracerl.EngineConfig(max_model_len=256)))
    await model.register(backend)
    await backend._experimental_pull_from_s3(model, verbose=True)
    assert await model.get_step() == 0


async def _step(model: tracerl.TrainableModel) -> dict[str, float]:
    async def rollout(reward: float) -> tracerl.Trajectory:
        r = await model.openai_client().chat.completions.create(
            model=model.get_inference_name(), max_tokens=4, temperature=1.0,
            messages=[{"role": "user", "content": "Pick a number."}])
        return tracerl.Trajectory(messages_and_choices=[r.choices[0]], reward=reward)

    groups = await tracerl.gather_trajectory_groups(
        [tracerl.TrajectoryGroup(rollout(r) for r in (0.0, 1.0, 2.0))], show_progress=False)
    return await model.train(groups, config=tracerl.TrainConfig(learning_rate=1e-3))


async def test_training_resumes_on_another_backend_from_the_pushed_checkpoint(
        s3_endpoint, tf_backend, tmp_path, monkeypatch):
    """ART's 2048 example: register, pull, train from ``await model.get_step()`` on."""
    monkeypatch.setenv("BACKUP_BUCKET", BUCKET)
    backend, _ = tf_backend
    config = tracerl.ModelConfig(engine=tracerl.EngineConfig(max_model_len=256))
    model = tracerl.TrainableModel(name="resumed", project="sync", base_model="smollm2",
                                   config=config)
    await model.register(backend)
    await _step(model)
    assert await model.get_step() == 1
    await backend._experimental_push_to_s3(model)

    other = tracerl.LocalBackend(path=tmp_path / "elsewhere", engine="transformers")
    try:
        again = tracerl.TrainableModel(name="resumed", project="sync", base_model="smollm2",
                                       config=config)
        await again.register(other)
        assert await again.get_step() == 0
        await other._experimental_pull_from_s3(again, verbose=True)
        assert await again.get_step() == 1
        # the pulled adapter is served at once
        assert other.gateway.models["sync/resumed"].step == 1
        await _step(again)
        assert await again.get_step() == 2
        store = other.store(again)
        # the step trained on from the pulled adapter and optimizer state: its count went on
        state = json.loads((store.checkpoint_dir(2) / "trainer_state.json").read_text())
        assert state["steps_done"] == 2
        assert [h["step"] for h in store.history() if h.get("split") == "train"] == [1, 2]
    finally:
        await other.close()


# --- deployment: ART's names import; calling deploy_model says what to do instead ----------


async def test_arts_deployment_imports_and_deploy_model_names_export_and_vllm_serve(tmp_path):
    import tracerl as art
    from tracerl.utils.deployment import TogetherDeploymentConfig, deploy_model

    config = TogetherDeploymentConfig(s3_bucket=BUCKET, wait_for_completion=True)
    assert art.utils.deployment.TogetherDeploymentConfig is TogetherDeploymentConfig
    with pytest.raises(tracerl.ConfigError, match=r"to together.*export_lora.*vllm serve"):
        await deploy_model(model=None, checkpoint_path=str(tmp_path), step=1,
                           provider="together", config=config, verbose=True)
