"""Training through the LocalBackend with the real model: checkpoints, swap, crash and resume."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import tracerl
from tracerl.core.storage import ModelStore
from tracerl.core.trajectory import read_groups_jsonl

ROOT = Path(__file__).resolve().parents[1]


async def _rollouts(model: tracerl.TrainableModel, rewards: list[float]
                    ) -> list[tracerl.TrajectoryGroup]:
    async def rollout(reward: float) -> tracerl.Trajectory:
        r = await model.openai_client().chat.completions.create(
            model=model.name, messages=[{"role": "user", "content": "Pick a number."}],
            max_tokens=4, temperature=1.0)
        return tracerl.Trajectory(messages_and_choices=[r.choices[0]], reward=reward)

    return await tracerl.gather_trajectory_groups(
        [tracerl.TrajectoryGroup(rollout(r) for r in rewards)], show_progress=False)


@pytest.fixture(scope="module")
async def trained(tf_backend):
    """One real step of a fresh model on three rollouts rewarded 0, 1 and 2."""
    backend, _ = tf_backend
    model = tracerl.TrainableModel(name="trainee", project="tests", base_model="smollm2")
    await model.register(backend)  # shares the engine of the same base model
    step_before = await model.get_step()
    groups = await _rollouts(model, [0.0, 1.0, 2.0])
    metrics = await model.train(groups, config=tracerl.TrainConfig(learning_rate=1e-3))
    return SimpleNamespace(model=model, store=backend.store(model), groups=groups,
                           metrics=metrics, step_before=step_before)


async def test_a_step_advances_the_model_from_0_to_1(trained):
    assert (trained.step_before, await trained.model.get_step()) == (0, 1)


async def test_a_step_writes_a_checkpoint_vllm_and_peft_can_load(trained):
    ckpt = trained.store.checkpoint_dir(1)
    assert (ckpt / "adapter_model.safetensors").exists()
    assert json.loads((ckpt / "adapter_config.json").read_text())["peft_type"] == "LORA"
    assert (ckpt / "optimizer.pt").exists()  # resume continues Adam where it was


async def test_a_step_moves_the_lora_weights(trained):
    from safetensors.torch import load_file

    tensors = load_file(trained.store.checkpoint_dir(1) / "adapter_model.safetensors")
    lora_b = [t for name, t in tensors.items() if "lora_B" in name]
    assert lora_b and all(float(t.abs().max()) > 0 for t in lora_b)  # peft starts B at zero


async def test_a_step_trains_on_the_engines_own_tokens(trained):
    m = trained.metrics
    assert (m["rows"], m["rendered_rows"]) == (3, 0) and m["trained_tokens"] > 0
    assert m["logprob_mismatch"] < 0.02  # engine and trainer agree on the sampled tokens
    assert abs(m["ratio"] - 1) < 0.02


async def test_a_steps_trajectories_are_on_disk_with_their_token_records(trained):
    (saved,) = read_groups_jsonl(trained.store.trajectories_path("train", 1))
    assert [t.rollout_id for t in saved] == [t.rollout_id for t in trained.groups[0]]
    assert all(t.llm_calls and t.llm_calls[0].prompt_token_ids for t in saved)


async def test_history_records_the_step_with_its_rewards(trained):
    (line,) = [h for h in await trained.model.history() if h["split"] == "train"]
    assert (line["step"], line["num_trajectories"], line["reward"]) == (1, 3, 1.0)
    assert "loss" in line


async def test_the_next_rollout_is_served_by_the_new_adapter(trained):
    model = trained.model
    with tracerl.rollout_scope() as ro:
        await model.openai_client().chat.completions.create(
            model=model.name, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    (call,) = await model.fetch_calls(ro.rollout_id)
    assert call.adapter_step == 1


def _evaluated(reward: float) -> list[tracerl.TrajectoryGroup]:
    trajectory = tracerl.Trajectory(messages_and_choices=[], reward=reward)
    return [tracerl.TrajectoryGroup([trajectory] * 2)]


async def test_a_group_of_equal_rewards_is_skipped_visibly_and_trains_nothing(tf_backend):
    backend, _ = tf_backend
    model = tracerl.TrainableModel(name="skipper", project="tests", base_model="smollm2")
    await model.register(backend)
    metrics = await model.train(_evaluated(1.0))
    assert (metrics["skipped"], metrics["skipped_groups"], metrics["loss"]) == (1.0, 1.0, 0.0)


async def test_delete_checkpoints_keeps_the_newest_and_the_best_logged_metric(trained):
    model, store = trained.model, trained.store
    await model.log(_evaluated(0.9), split="val", metrics={"accuracy": 0.1})  # step 1
    await model.train(_evaluated(1.0))  # a second checkpoint
    await model.log(_evaluated(0.2), split="val", metrics={"accuracy": 0.5})  # step 2
    # ART's default, val/reward: step 1 is the best, step 2 the newest
    assert await model.delete_checkpoints(keep_last=1) == []
    # by a metric name in the default split: step 2 is best and newest
    assert await model.delete_checkpoints("accuracy", keep_last=1) == [1]
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

    store = ModelStore(tmp_path, "tests", "crashy")
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
