"""Training through the LocalBackend with the real model: checkpoints, swap, crash and resume."""

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
from safetensors.torch import load_file

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


async def test_a_step_writes_a_peft_lora_checkpoint_that_peft_loads(trained, smollm2_path):
    """The format vLLM's ``--lora-modules`` reads is peft's: loading it with peft proves it."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ckpt = trained.store.checkpoint_dir(1)
    assert json.loads((ckpt / "adapter_config.json").read_text())["peft_type"] == "LORA"
    base = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32)
    loaded = dict(PeftModel.from_pretrained(base, ckpt).named_parameters())
    saved = load_file(ckpt / "adapter_model.safetensors")
    lora_b = [name for name in saved if "lora_B" in name]
    assert lora_b
    for name in lora_b:  # peft names them without the adapter name; loaded, they carry it
        (match,) = [p for n, p in loaded.items() if n.replace(".default", "") == name]
        assert torch.equal(match.detach(), saved[name])


async def test_a_checkpoint_keeps_the_adam_state_for_resuming(trained):
    import torch

    state = torch.load(trained.store.checkpoint_dir(1) / "optimizer.pt")
    moments = [s for s in state["state"].values() if "exp_avg" in s]
    assert moments and any(float(s["exp_avg"].abs().max()) > 0 for s in moments)


async def test_a_step_moves_the_lora_weights(trained):
    tensors = load_file(trained.store.checkpoint_dir(1) / "adapter_model.safetensors")
    lora_b = [t for name, t in tensors.items() if "lora_B" in name]
    assert lora_b and all(float(t.abs().max()) > 0 for t in lora_b)  # peft starts B at zero


def sampled_tokens(group: tracerl.TrajectoryGroup) -> list[list[int]]:
    return [c.completions[0].token_ids for t in group for c in t.llm_calls]


async def test_a_step_trains_exactly_the_tokens_the_engine_sampled(trained):
    m, tokens = trained.metrics, sampled_tokens(trained.groups[0])
    assert len(tokens) == 3  # one recorded call per rollout
    assert (m["rows"], m["rendered_rows"]) == (3, 0)
    assert m["trained_tokens"] == sum(len(t) for t in tokens)


async def test_trainer_and_engine_agree_on_the_sampled_tokens_logprobs(trained):
    m = trained.metrics
    assert m["logprob_mismatch"] < 0.02  # mean |trainer - engine| per trained token
    assert abs(m["ratio"] - 1) < 0.02


async def test_a_steps_trajectories_are_on_disk_with_their_token_records(trained):
    (saved,) = read_groups_jsonl(trained.store.trajectories_path("train", 1))
    assert [t.rollout_id for t in saved] == [t.rollout_id for t in trained.groups[0]]
    assert [[c.prompt_token_ids for c in t.llm_calls] for t in saved] == [
        [c.prompt_token_ids for c in t.llm_calls] for t in trained.groups[0]]
    assert sampled_tokens(saved) == sampled_tokens(trained.groups[0])


async def test_history_records_the_step_with_its_rewards_and_loss(trained):
    (line,) = [h for h in await trained.model.history() if h["split"] == "train"]
    assert (line["step"], line["num_trajectories"], line["reward"]) == (1, 3, 1.0)
    assert line["loss"] == trained.metrics["loss"]


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
    tensors = load_file(backend.store(model).checkpoint_dir(1) / "adapter_model.safetensors")
    lora_b = [t for name, t in tensors.items() if "lora_B" in name]
    assert lora_b and all(float(t.abs().max()) == 0 for t in lora_b)  # still peft's zero init


BEST_METRICS = {
    # id: (delete_checkpoints' keyword arguments, the steps it deletes); step 1 logs val reward
    # 0.9 and accuracy 0.1, step 2 (the newest) val reward 0.2 and accuracy 0.5
    "art-default-val-reward-keeps-best-and-newest": ({}, [1, 2], []),
    "metric-name-in-val-split-best-is-newest": ({"best_checkpoint_metric": "accuracy"}, [2], [1]),
}


@pytest.mark.parametrize("kwargs, kept, deleted", BEST_METRICS.values(), ids=list(BEST_METRICS))
async def test_delete_checkpoints_keeps_the_newest_and_the_best_logged_metric(
        tf_backend, kwargs, kept, deleted):
    backend, _ = tf_backend
    model = tracerl.TrainableModel(name=f"pruner-{uuid.uuid4().hex[:8]}", project="tests",
                                   base_model="smollm2")
    await model.register(backend)
    for reward, accuracy in ((0.9, 0.1), (0.2, 0.5)):
        await model.train(_evaluated(1.0))  # a checkpoint (skipped step: no signal, cheap)
        await model.log(_evaluated(reward), split="val", metrics={"accuracy": accuracy})
    assert backend.store(model).checkpoint_steps() == [1, 2]
    assert await model.delete_checkpoints(keep_last=1, **kwargs) == deleted
    assert backend.store(model).checkpoint_steps() == kept


BAD_TRAIN_INPUT = {
    "not-awaited": ([object()], "forget to await"),
    "no-groups": ([], "no trajectory groups"),
}


@pytest.mark.parametrize("groups, message", BAD_TRAIN_INPUT.values(), ids=list(BAD_TRAIN_INPUT))
async def test_train_rejects_bad_input_naming_the_mistake(tf_backend, groups, message):
    _, model = tf_backend
    with pytest.raises(tracerl.InvalidTrajectoryError, match=message):
        await model.train(groups)


def lines_until(proc: subprocess.Popen, marker: str, timeout_s: float) -> list[str]:
    """The lines ``proc`` prints up to and including ``marker``; fails after ``timeout_s``
    (the reading happens in a thread, so a silent process cannot block the deadline)."""
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:
            lines.put(line.strip())
        lines.put(None)  # end of output

    threading.Thread(target=pump, daemon=True).start()
    deadline, seen = time.monotonic() + timeout_s, []
    while not seen or seen[-1] != marker:
        try:
            line = lines.get(timeout=max(deadline - time.monotonic(), 0))
        except queue.Empty:
            raise AssertionError(f"waited {timeout_s} s for {marker!r}; printed: {seen}") from None
        assert line is not None, f"exited ({proc.wait()}) before printing {marker!r}: {seen}"
        seen.append(line)
    return seen


@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory):
    """``train_script.py``: step 1 trained, killed with SIGKILL while hanging inside step 2,
    then a new process that reopens the store and trains the pending step."""
    path = tmp_path_factory.mktemp("crashy")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRACERL_QUIET": "1"}
    script = str(ROOT / "tests" / "train_script.py")
    proc = subprocess.Popen([sys.executable, script, str(path), "crash"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env, start_new_session=True)
    try:
        lines = lines_until(proc, "HANGING", timeout_s=400)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    store = ModelStore(path, "tests", "crashy")
    after_kill = SimpleNamespace(lines=lines, checkpoints=store.checkpoint_steps(),
                                 pending_saved=store.trajectories_path("train", 2).exists())
    out = subprocess.run([sys.executable, script, str(path), "resume"], capture_output=True,
                         text=True, env=env, timeout=400)
    report_lines = [ln for ln in out.stdout.splitlines() if ln.startswith("REPORT ")]
    assert len(report_lines) == 1, out.stderr[-3000:]
    return SimpleNamespace(after_kill=after_kill, report=json.loads(report_lines[0][7:]))


def test_kill_9_mid_step_keeps_the_last_checkpoint_and_the_steps_trajectories(
        killed_and_resumed):
    after_kill = killed_and_resumed.after_kill
    assert after_kill.lines[-2:] == ["STEP 1", "HANGING"]
    assert after_kill.checkpoints == [1]  # step 2 never published a half-written checkpoint
    assert after_kill.pending_saved  # step 2's trajectories were written before training


def test_resume_after_kill_9_trains_the_pending_step_from_its_saved_trajectories(
        killed_and_resumed):
    assert killed_and_resumed.report == {
        "step_after_restart": 1,
        "pending_trajectories": 4,
        "pending_have_tokens": True,
        "step_after_training": 2,
    }


async def test_a_policy_closed_to_bound_memory_reloads_exactly_from_its_checkpoint(tf_backend):
    """With one resident policy, training model B (another LoRA shape: its own base weights)
    closes model A's; A's policy then reloads from its newest checkpoint with the same LoRA
    weights and Adam state it had."""
    import torch

    from tracerl.core.model_spec import spec_of

    backend, _ = tf_backend
    a, b = (tracerl.TrainableModel(name=f"resident-{x}", project="tests", base_model="smollm2",
                                   config=tracerl.ModelConfig(lora=tracerl.LoraConfig(r=r)))
            for x, r in (("a", 8), ("b", 4)))
    for m in (a, b):
        await m.register(backend)
    await a.train(await _rollouts(a, [0.0, 1.0]), config=tracerl.TrainConfig(learning_rate=1e-3))
    key_a, key_b = (str(backend.store(m).root) for m in (a, b))
    kept = backend.policies.loaded[key_a]  # the policy in memory (its cache)
    lora = [p.detach().clone() for p in kept.trainable_parameters()]
    adam = {i: {k: v.clone() for k, v in s.items()}
            for i, s in kept.optimizer.state_dict()["state"].items()}
    del kept
    backend.policies.resident = 1
    try:
        await b.train(await _rollouts(b, [0.0, 1.0]),
                      config=tracerl.TrainConfig(learning_rate=1e-3))
        assert list(backend.policies.loaded) == [key_b]
        reloaded = backend.steps.load_policy(spec_of(a))
        assert list(backend.policies.loaded) == [key_a]
    finally:
        backend.policies.resident = 2
    again = [p.detach() for p in reloaded.trainable_parameters()]
    assert len(again) == len(lora)
    assert all(torch.equal(x, y) for x, y in zip(again, lora, strict=True))
    state = reloaded.optimizer.state_dict()["state"]
    assert state.keys() == adam.keys()
    assert all(torch.equal(state[i][k], v) for i, s in adam.items() for k, v in s.items())


async def test_only_the_newest_checkpoint_keeps_the_optimizer_state(tf_backend):
    """Training resumes from the newest checkpoint alone, so a step drops the Adam state of the
    ones before it (twice an adapter's size each); their adapters stay."""
    from tracerl.core.storage import OPTIMIZER_FILE

    backend, _ = tf_backend
    model = tracerl.TrainableModel(name="optimizer-kept", project="tests", base_model="smollm2")
    await model.register(backend)
    for _ in range(2):
        await model.train(await _rollouts(model, [0.0, 1.0]),
                          config=tracerl.TrainConfig(learning_rate=1e-3))
    first, second = (backend.store(model).checkpoint_dir(step) for step in (1, 2))
    assert (first / "adapter_model.safetensors").exists()
    assert not (first / OPTIMIZER_FILE).exists()
    assert (second / OPTIMIZER_FILE).exists() and (second / "adapter_model.safetensors").exists()
