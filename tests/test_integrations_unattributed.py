"""Nothing fails silently: calls no trajectory holds are counted and warned about, and a step
with no training signal says why, against the real gateway and SmolLM2."""

from __future__ import annotations

import asyncio

import pytest

import tracerl
from tracerl.rollout.client import unattributed_calls
from tracerl.rollout.gather import why_no_training_data


async def _say(model, word: str) -> str:
    r = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), max_tokens=2,
        messages=[{"role": "user", "content": f"Say {word}"}])
    return r.choices[0].message.content or ""


async def test_a_call_outside_any_rollout_is_counted_and_warned_with_the_fix(
        tf_backend, caplog, monkeypatch):
    _, model = tf_backend
    monkeypatch.setitem(unattributed_calls, "no_rollout", 0)  # so this call is the one warned
    with caplog.at_level("WARNING"):
        await _say(model, "yes")
    assert unattributed_calls["no_rollout"] == 1
    assert "outside any rollout" in caplog.text and "rollout_scope" in caplog.text


async def test_a_call_after_its_rollout_finished_is_counted_and_warned(
        tf_backend, caplog, monkeypatch):
    _, model = tf_backend
    finished = asyncio.Event()
    late: list[asyncio.Task] = []

    async def rollout() -> tracerl.Trajectory:
        async def after_return() -> str:
            await finished.wait()
            return await _say(model, "late")
        late.append(asyncio.create_task(after_return()))  # never awaited by the rollout
        return tracerl.Trajectory(reward=0.0)

    monkeypatch.setitem(unattributed_calls, "rollout_closed", 0)  # so this call is the one warned
    (group,) = await tracerl.gather_trajectory_groups(
        [tracerl.TrajectoryGroup([rollout()])], show_progress=False)
    finished.set()
    with caplog.at_level("WARNING"):
        await late[0]
    assert unattributed_calls["rollout_closed"] == 1
    assert group.trajectories[0].llm_calls == []  # the late call is in no trajectory
    assert group.trajectories[0].rollout_id in caplog.text and "await every task" in caplog.text


@pytest.fixture(scope="module")
async def answered_group(tf_backend):
    _, model = tf_backend

    async def rollout(word: str, reward: float) -> tracerl.Trajectory:
        await _say(model, word)
        return tracerl.Trajectory(reward=reward)

    (group,) = await tracerl.gather_trajectory_groups(
        [tracerl.TrajectoryGroup([rollout("yes", 1.0), rollout("no", 0.0)])],
        show_progress=False)
    return group


def _group(trajectories):
    return tracerl.TrajectoryGroup(trajectories)


async def test_a_step_with_signal_needs_no_explanation(answered_group):
    assert why_no_training_data([answered_group]) is None


async def test_equal_rewards_are_named_as_the_reason(answered_group):
    for traj in answered_group.trajectories:
        traj.reward = 0.5
    try:
        assert "all rewards are equal" in why_no_training_data([answered_group])
    finally:
        answered_group.trajectories[0].reward, answered_group.trajectories[1].reward = 1.0, 0.0


def test_rollouts_without_attributed_calls_are_named_as_the_reason():
    group = _group([tracerl.Trajectory(reward=1.0), tracerl.Trajectory(reward=0.0)])
    assert "no calls were attributed" in why_no_training_data([group])


def test_groups_that_all_failed_are_named_as_the_reason():
    failed = tracerl.TrajectoryGroup([RuntimeError("tool down"), ValueError("bad json")])
    assert "all groups failed (2 rollout exceptions" in why_no_training_data([failed])


async def test_train_warns_why_a_step_has_no_signal(tf_backend, caplog):
    _, model = tf_backend
    group = _group([tracerl.Trajectory(reward=1.0, messages_and_choices=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])] * 2)
    with caplog.at_level("WARNING"):
        try:
            await model.train([group])
        except Exception:
            pass
    assert "this step has no training signal" in caplog.text
