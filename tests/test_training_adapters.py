"""Many adapters on one base (issue 32): models sharing a base model and LoRA shape share one
copy of its weights in the trainer; ``backend.train_many`` trains their rows in shared passes,
each adapter's update being the one of training it alone; a model whose step fails leaves the
others' files and state as they were; a kill -9 mid-step then a resume trains each model's
groups exactly once."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import tracerl
from tracerl.backend.training.adapters import SharedBase, optimize_together
from tracerl.core.errors import StepsFailedError
from tracerl.core.model_spec import spec_of

from .test_training_distributed import CONFIG, LORA, assert_same_checkpoint, tiny_rows
from .test_training_distributed import one_process as one_process  # a fixture
from .test_training_step import _rollouts, lines_until

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("mixed", [True, False], ids=["mixed-micro-batches", "per-adapter"])
def test_adapters_on_one_base_train_in_one_pass_as_each_alone(one_process, smollm2_path, mixed):
    """Adapter A (from the random init) and adapter B (from the reference's step-1 checkpoint,
    Adam state included) train their rows in one step over the shared base (micro-batches
    mixing both adapters' rows, or one adapter's each): A equals the one-process step 1, B the
    one-process step 2."""
    shared = SharedBase(smollm2_path, LORA, device="cpu")
    a = shared.attach(one_process.init)
    b = shared.attach(one_process.root / "one-1")
    assert a.model is b.model  # one base, two named adapters
    metrics = optimize_together([a, b], [tiny_rows(0), tiny_rows(1)], CONFIG, mixed=mixed)
    for ours, reference in zip(metrics, one_process.metrics, strict=True):
        for key in ("loss", "ratio", "clip_fraction", "entropy", "grad_norm"):
            assert ours[key] == pytest.approx(reference[key], rel=1e-4), key
        assert ours["trained_tokens"] == reference["trained_tokens"]
    for policy, name in ((a, "one-1"), (b, "one-2")):
        policy.save(one_process.root / f"together-{mixed}-{name}")
    out = {n: one_process.root / f"together-{mixed}-{n}" for n in ("one-1", "one-2")}
    assert_same_checkpoint(out["one-1"], one_process.root / "one-1")
    assert_same_checkpoint(out["one-2"], one_process.root / "one-2", one_process.root / "one-1")
    assert json.loads((out["one-2"] / "trainer_state.json").read_text())["steps_done"] == 2


def test_n_adapters_cost_the_base_once_plus_n_adapters(smollm2_path):
    shared = SharedBase(smollm2_path, LORA, device="cpu")
    base = sum(p.numel() for p in shared._base.parameters())
    policies = [shared.attach(None) for _ in range(3)]
    adapter = sum(p.numel() for p in policies[0].trainable_parameters())
    assert adapter == 30 * 8 * ((576 + 576) + (576 + 192))  # A and B of q (576->576), v (->192)
    assert sum(p.numel() for p in shared.model.parameters()) == base + 3 * adapter
    policies[1].close()  # its adapter goes; the others keep theirs, trainable
    assert sum(p.numel() for p in shared.model.parameters()) == base + 2 * adapter
    assert all(p.requires_grad for q in (policies[0], policies[2])
               for p in q.trainable_parameters())


def _adapter_state(policy) -> dict:
    return {"lora": [p.detach().clone() for p in policy.trainable_parameters()],
            "adam": {i: {k: v.clone() for k, v in s.items()}
                     for i, s in policy.optimizer.state_dict()["state"].items()},
            "steps": policy.steps_done}


def _same_state(got: dict, want: dict) -> bool:
    return (got["steps"] == want["steps"]
            and all(torch.equal(x, y) for x, y in zip(got["lora"], want["lora"], strict=True))
            and got["adam"].keys() == want["adam"].keys()
            and all(torch.equal(got["adam"][i][k], v) for i, s in want["adam"].items()
                    for k, v in s.items()))


def _files(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
async def pair(tf_backend):
    """Two models of the session's base and LoRA shape, trained together one step."""
    backend, _ = tf_backend
    a, b = (tracerl.TrainableModel(name=f"pair-{x}", project="tests", base_model="smollm2")
            for x in "ab")
    for m in (a, b):
        await m.register(backend)
    groups = {a: await _rollouts(a, [0.0, 1.0]), b: await _rollouts(b, [1.0, 0.0, 2.0])}
    results = await backend.train_many(groups, config=tracerl.TrainConfig(learning_rate=1e-3))
    return SimpleNamespace(backend=backend, a=a, b=b, groups=groups, results=results)


async def test_train_many_trains_each_model_one_step_on_one_shared_base(pair):
    backend, a, b = pair.backend, pair.a, pair.b
    assert {m: r.step for m, r in pair.results.items()} == {a: 1, b: 1}
    policies = [backend.policies.loaded[str(backend.store(m).root)] for m in (a, b)]
    assert policies[0].shared is policies[1].shared  # private: the policies have no handle
    for m, trajectories in ((a, 2), (b, 3)):
        metrics = pair.results[m].metrics
        assert metrics["models_in_step"] == 2
        assert metrics["num_trajectories"] == trajectories
        assert metrics["rows"] == trajectories  # each model trained on its own rows only
        store = backend.store(m)
        assert store.checkpoint_steps() == [1]
        assert [h["step"] for h in store.history() if h["split"] == "train"] == [1]
        # published: the next call is served by the new adapter, and recorded under its model
        with tracerl.rollout_scope() as ro:
            await m.openai_client().chat.completions.create(
                model=m.name, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
        (call,) = await m.fetch_calls(ro.rollout_id)
        assert call.adapter_step == 1 and call.model == m.name


async def test_a_failed_step_leaves_the_other_models_files_and_state_as_they_were(pair):
    """Model A's checkpoint cannot be written (a file stands where its step-2 folder goes):
    A's part of a multi-model step fails, B's finishes; then A's own step fails the same way.
    B's adapter, Adam state and files are untouched by A's failures; A keeps its files and
    reloads its checkpoint, and trains once the path is free."""
    backend, a, b = pair.backend, pair.a, pair.b
    key_b = str(backend.store(b).root)
    store_a = backend.store(a)
    blocked = store_a.checkpoint_dir(2)
    blocked.write_text("not a folder")  # the checkpoint's rename fails, even for root
    config = tracerl.TrainConfig(learning_rate=1e-3)
    try:
        with pytest.raises(StepsFailedError) as failed:
            await backend.train_many({a: await _rollouts(a, [0.0, 1.0]),
                                      b: await _rollouts(b, [0.0, 1.0])}, config=config)
        assert list(failed.value.failed) == [spec_of(a).key]
        assert backend.store(b).checkpoint_steps() == [1, 2]
        assert str(store_a.root) not in backend.policies.loaded  # reloads from its checkpoint
        b_state = _adapter_state(backend.policies.loaded[key_b])
        b_files = _files(backend.store(b).root)
        with pytest.raises(tracerl.TracerlError):
            await a.train(await _rollouts(a, [0.0, 1.0]), config=config)
        assert _same_state(_adapter_state(backend.policies.loaded[key_b]), b_state)
        assert _files(backend.store(b).root) == b_files
    finally:
        blocked.unlink()
    assert store_a.checkpoint_steps() == [1]
    assert len(await backend.pending_groups(a)) == 1  # the failed step's groups, for a retry
    await a.train(await backend.pending_groups(a), config=config)
    assert store_a.checkpoint_steps() == [1, 2]
    assert _same_state(_adapter_state(backend.policies.loaded[key_b]), b_state)


async def test_train_many_validates_before_writing(pair):
    backend, a = pair.backend, pair.a
    with pytest.raises(tracerl.InvalidTrajectoryError, match="pair-a"):
        await backend.train_many({a: ["not a group"]})
    assert await backend.train_many({a: []}) == {}  # no groups: no step
    assert backend.store(a).checkpoint_steps()[-1] == await a.get_step()


async def test_train_many_checks_every_models_rows_first_and_trains_the_healthy_ones(pair):
    """Model A's rows hold a token id past the vocabulary, B's a reward of 1e308: both are
    refused (naming the model and the field) before anything trains; then A's bad rows beside
    B's healthy ones: B trains and its result comes with the error, A takes no step and writes
    nothing. Before, a bare IndexError / FloatingPointError failed both models' step."""
    backend, a, b = pair.backend, pair.a, pair.b
    steps = {m: await m.get_step() for m in (a, b)}
    bad_ids = await _rollouts(a, [0.0, 1.0])
    bad_ids[0].trajectories[0].messages_and_choices[0].model_extra["token_ids"] = [49152]
    bad_reward = await _rollouts(b, [0.0, 1.0])
    bad_reward[0].trajectories[1].reward = 1e308
    files = {m: _files(backend.store(m).root) for m in (a, b)}
    with pytest.raises(StepsFailedError) as failed:
        await backend.train_many({a: bad_ids, b: bad_reward})
    assert failed.value.results == {}
    for m, field in ((a, "messages_and_choices[0].token_ids[0]"), (b, "trajectories[1].reward")):
        error = failed.value.failed[spec_of(m).key]
        assert isinstance(error, tracerl.InvalidTrajectoryError)
        assert spec_of(m).key in str(error) and field in str(error), error
        assert _files(backend.store(m).root) == files[m] and await m.get_step() == steps[m]
    with pytest.raises(StepsFailedError) as failed:
        await backend.train_many({a: bad_ids, b: await _rollouts(b, [0.0, 1.0])})
    assert list(failed.value.failed) == [spec_of(a).key]
    assert failed.value.results[b].step == steps[b] + 1 == await b.get_step()
    assert await a.get_step() == steps[a] and _files(backend.store(a).root) == files[a]


@pytest.fixture(scope="module")
def killed_between_checkpoints(tmp_path_factory):
    """``train_many_script.py``: a two-model step killed with SIGKILL after the first model's
    checkpoint, before the second's; then a new process trains what is pending."""
    path = tmp_path_factory.mktemp("many-crash")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRACERL_QUIET": "1"}
    script = str(ROOT / "tests" / "train_many_script.py")
    proc = subprocess.Popen([sys.executable, script, str(path), "crash"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env, start_new_session=True)
    try:
        lines = lines_until(proc, "HANGING", timeout_s=600)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    out = subprocess.run([sys.executable, script, str(path), "resume"], capture_output=True,
                         text=True, env=env, timeout=600)
    report_lines = [ln for ln in out.stdout.splitlines() if ln.startswith("REPORT ")]
    assert len(report_lines) == 1, out.stderr[-3000:]
    return SimpleNamespace(lines=lines, report=json.loads(report_lines[0][7:]))


def test_kill_9_in_a_multi_model_step_then_resume_trains_each_models_groups_once(
        killed_between_checkpoints):
    assert killed_between_checkpoints.lines[-2:] == ["DONE tests/first", "HANGING"]
    assert killed_between_checkpoints.report == {
        "after_restart": {"tests/first": 1, "tests/second": 0},
        "pending_trajectories": {"tests/first": 0, "tests/second": 4},
        "trained": ["tests/second"],
        "after_resume": {"tests/first": 1, "tests/second": 1},
        "train_history_steps": {"tests/first": [1], "tests/second": [1]},
        "saved_trajectory_files": {"tests/first": ["0001.jsonl"], "tests/second": ["0001.jsonl"]},
    }
