"""Training through the LocalBackend with the real model: checkpoints, swap, crash and resume."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import tracerl

ROOT = Path(__file__).resolve().parents[1]


async def test_train_step_saves_checkpoint_and_serves_it(tf_backend):
    backend, _ = tf_backend
    model = tracerl.TrainableModel(name="trainee", project="tests", base_model="smollm2")
    await model.register(backend)  # shares the engine of the same base model
    assert await model.get_step() == 0

    async def rollout(i):
        r = await model.openai_client().chat.completions.create(
            model=model.name, messages=[{"role": "user", "content": "Pick a number."}],
            max_tokens=4, temperature=1.0)
        return tracerl.Trajectory(messages_and_choices=[r.choices[0]], reward=float(i))

    groups = await tracerl.gather_trajectory_groups(
        [tracerl.TrajectoryGroup(rollout(i) for i in range(3))], show_progress=False)
    metrics = await model.train(groups, config=tracerl.TrainConfig(learning_rate=1e-3))
    store = backend.store(model)
    assert await model.get_step() == 1
    ckpt = store.checkpoint_dir(1)
    assert (ckpt / "adapter_model.safetensors").exists() and (ckpt / "adapter_config.json").exists()
    assert (ckpt / "optimizer.pt").exists()
    # peft starts every LoRA B at zero: a trained step has moved them
    from safetensors.torch import load_file

    lora_b = [t for k, t in load_file(ckpt / "adapter_model.safetensors").items() if "lora_B" in k]
    assert lora_b and all(float(t.abs().max()) > 0 for t in lora_b)
    assert store.trajectories_path("train", 1).exists()
    assert metrics["rows"] == 3 and metrics["rendered_rows"] == 0 and metrics["trained_tokens"] > 0
    assert metrics["logprob_mismatch"] < 0.02  # engine and trainer agree on the sampled tokens
    assert abs(metrics["ratio"] - 1) < 0.02
    (train_line,) = [h for h in await model.history() if h["split"] == "train"]
    assert train_line["step"] == 1 and "loss" in train_line
    assert train_line["reward"] == 1.0 and train_line["num_trajectories"] == 3  # rewards 0, 1, 2

    with tracerl.rollout_scope() as ro:
        await model.openai_client().chat.completions.create(
            model=model.name, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    (call,) = await model.fetch_calls(ro.rollout_id)
    assert call.adapter_step == 1

    def evaluated(reward):
        return [
            tracerl.TrajectoryGroup(
                [tracerl.Trajectory(messages_and_choices=[], reward=reward)] * 2
            )
        ]

    await model.log(evaluated(0.9), split="val", metrics={"accuracy": 0.1})  # step 1 evaluates best
    # zero-variance groups are skipped visibly, and nothing is trained
    same = tracerl.TrajectoryGroup([tracerl.Trajectory(messages_and_choices=[], reward=1.0)] * 2)
    skipped = await model.train([same])
    assert skipped["skipped"] == 1.0 and skipped["skipped_groups"] == 1.0
    assert await model.get_step() == 2
    await model.log(evaluated(0.2), split="val", metrics={"accuracy": 0.5})

    assert (
        await model.delete_checkpoints(keep_last=1) == []
    )  # ART's default: the best val/reward stays
    assert await model.delete_checkpoints("accuracy", keep_last=1) == [
        1
    ]  # best in split "val": step 2
    assert store.checkpoint_steps() == [2]


async def test_train_rejects_bad_input(tf_backend):
    _, model = tf_backend
    with pytest.raises(tracerl.InvalidTrajectoryError, match="forget to await"):
        await model.train([object()])
    with pytest.raises(tracerl.InvalidTrajectoryError, match="no trajectory groups"):
        await model.train([])


def test_kill_9_mid_step_then_resume_loses_nothing(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRACERL_QUIET": "1"}
    script = str(ROOT / "tests" / "train_script.py")
    proc = subprocess.Popen(
        [sys.executable, script, str(tmp_path), "crash"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
        start_new_session=True,
    )
    deadline = time.time() + 400
    lines = []
    for line in proc.stdout:
        lines.append(line.strip())
        if line.startswith("HANGING") or time.time() > deadline:
            break
    assert "STEP 1" in lines and "HANGING" in lines, lines
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()

    store = tracerl.core.storage.ModelStore(tmp_path, "tests", "crashy")
    assert store.checkpoint_steps() == [1]
    assert store.trajectories_path("train", 2).exists()  # written before training started

    out = subprocess.run([sys.executable, script, str(tmp_path), "resume"], capture_output=True,
                         text=True, env=env, timeout=400)
    report_line = [ln for ln in out.stdout.splitlines() if ln.startswith("REPORT ")]
    assert report_line, out.stderr[-3000:]
    report = json.loads(report_line[0][7:])
    assert report == {
        "step_after_restart": 1,
        "pending_trajectories": 4,
        "pending_have_tokens": True,
        "step_after_training": 2,
    }
