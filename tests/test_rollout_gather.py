import asyncio
import json
import time

import pytest

import tracerl
from tests.echo_server import EchoServer


def traj(reward=1.0, **kw):
    return tracerl.Trajectory(
        messages_and_choices=[{"role": "user", "content": "x"}], reward=reward, **kw
    )


async def ok(reward=1.0, delay=0.0):
    await asyncio.sleep(delay)
    return traj(reward)


async def fail(msg="boom"):
    await asyncio.sleep(0)
    raise ValueError(msg)


async def test_groups_come_back_in_input_order_with_trajectories():
    groups = await tracerl.gather_trajectory_groups(
        (tracerl.TrajectoryGroup(ok(r, delay=0.02 * (3 - r)) for _ in range(3)) for r in range(3)),
        show_progress=False,
    )
    assert [g.trajectories[0].reward for g in groups] == [0.0, 1.0, 2.0]
    assert all(len(g) == 3 for g in groups)
    ids = {t.rollout_id for g in groups for t in g}
    assert len(ids) == 9 and all(i.startswith("ro-") for i in ids)


async def test_exceptions_within_budget_are_kept_in_group():
    (g,) = await tracerl.gather_trajectory_groups(
        [tracerl.TrajectoryGroup([ok(), fail("bad rollout"), ok()])], max_exceptions=1,
        show_progress=False)
    assert len(g.trajectories) == 2
    assert [e.type for e in g.exceptions] == ["ValueError"]
    assert "bad rollout" in g.exceptions[0].message


async def test_too_many_exceptions_raise_and_name_the_first():
    with pytest.raises(
        tracerl.TooManyExceptionsError, match=r"2 of 3 rollouts failed.*ValueError: first"
    ):
        await tracerl.gather_trajectory_groups(
            [tracerl.TrajectoryGroup([fail("first"), fail("second"), ok()])], max_exceptions=1,
            show_progress=False)


async def test_fractional_max_exceptions():
    groups = [tracerl.TrajectoryGroup([ok(), ok(), ok(), ok(), fail()]) for _ in range(2)]
    out = await tracerl.gather_trajectory_groups(groups, max_exceptions=0.2, show_progress=False)
    assert sum(len(g.exceptions) for g in out) == 2
    with pytest.raises(tracerl.TooManyExceptionsError):
        await tracerl.gather_trajectory_groups(
            [tracerl.TrajectoryGroup([ok(), ok(), ok(), fail(), fail()])], max_exceptions=0.2,
            show_progress=False)


async def test_stuck_rollout_times_out_instead_of_hanging():
    started = time.monotonic()
    (g,) = await tracerl.gather_trajectory_groups(
        [tracerl.TrajectoryGroup([ok(), ok(delay=3600)])], max_exceptions=1, rollout_timeout=0.2,
        show_progress=False)
    assert time.monotonic() - started < 5
    assert g.exceptions[0].type == "RolloutTimeoutError"
    assert "did not finish within 0.2 s" in g.exceptions[0].message


async def test_failing_gather_cancels_the_other_rollouts():
    cancelled = asyncio.Event()

    async def slow():
        try:
            await asyncio.sleep(3600)  # a rollout that would hang: only cancelling ends it
        except asyncio.CancelledError:
            cancelled.set()
            raise

    with pytest.raises(tracerl.TooManyExceptionsError):
        await tracerl.gather_trajectory_groups(
            [tracerl.TrajectoryGroup([fail()]), tracerl.TrajectoryGroup([slow()])],
            show_progress=False)
    await asyncio.wait_for(cancelled.wait(), 10)


async def test_rollout_returning_wrong_type_is_an_exception():
    async def bad():
        return {"reward": 1}

    (g,) = await tracerl.gather_trajectory_groups(
        [tracerl.TrajectoryGroup([bad(), ok()])], max_exceptions=1, show_progress=False)
    assert "must return a tracerl.Trajectory, got dict" in g.exceptions[0].message


async def test_after_each_can_replace_or_drop_groups():
    async def judge(group):
        if group.trajectories[0].reward == 0:
            return None
        for t in group.trajectories:
            t.reward = 10.0
        return group

    out = await tracerl.gather_trajectory_groups(
        [tracerl.TrajectoryGroup([ok(0)]), tracerl.TrajectoryGroup([ok(1)])], after_each=judge,
        show_progress=False)
    assert [t.reward for g in out for t in g] == [10.0]


async def test_awaiting_a_group_directly_keeps_all_exceptions():
    g = await tracerl.TrajectoryGroup([fail(), ok()])
    assert len(g.trajectories) == 1 and len(g.exceptions) == 1


async def test_gather_trajectories_flat():
    out = await tracerl.gather_trajectories([ok(1), ok(2)], show_progress=False)
    assert sorted(t.reward for t in out) == [1.0, 2.0]


async def test_max_exceptions_validation():
    with pytest.raises(ValueError, match="max_exceptions"):
        await tracerl.gather_trajectory_groups([tracerl.TrajectoryGroup([ok()])], max_exceptions=-1)


async def test_200_concurrent_rollouts_keep_their_context_and_calls_apart():
    """Each rollout's requests carry its own id through tasks, to_thread and executors."""
    server = EchoServer()
    model = tracerl.Model(
        name="m", project="p", inference_base_url=server.url, inference_api_key="k"
    )
    client = model.openai_client()  # one shared client for all rollouts
    sync_client = model.sync_openai_client()
    pool = tracerl.ContextThreadPoolExecutor(max_workers=8)

    async def rollout(i):
        me = tracerl.current_rollout().rollout_id
        seen = []
        for _ in range(2):
            await asyncio.sleep(0.001 * (i % 7))
            r = await client.chat.completions.create(
                model=f"m{i}", messages=[{"role": "user", "content": "hi"}]
            )
            seen.append(json.loads(r.choices[0].message.content))
        # sub-task, thread and executor all see the same rollout
        sub = await asyncio.create_task(
            asyncio.sleep(0, result=tracerl.current_rollout().rollout_id)
        )
        in_thread = await asyncio.to_thread(lambda: tracerl.current_rollout().rollout_id)
        in_pool = await asyncio.wrap_future(
            pool.submit(lambda: tracerl.current_rollout().rollout_id)
        )
        sync_seen = await asyncio.wrap_future(
            pool.submit(
                lambda: json.loads(
                    sync_client.chat.completions.create(
                        model="s", messages=[{"role": "user", "content": "x"}]
                    )
                    .choices[0]
                    .message.content
                )
            )
        )
        return traj(metadata={"me": me, "seen": [*seen, sync_seen], "sub": sub, "thread": in_thread,
                              "pool": in_pool})

    try:
        groups = await tracerl.gather_trajectory_groups(
            [tracerl.TrajectoryGroup(rollout(g * 20 + i) for i in range(20)) for g in range(10)],
            show_progress=False)
    finally:
        server.close()
        pool.shutdown()
    trajs = [t for g in groups for t in g]
    assert len(trajs) == 200
    assert len({t.rollout_id for t in trajs}) == 200
    for t in trajs:
        me = t.metadata["me"]
        assert t.rollout_id == me
        assert t.metadata["sub"] == t.metadata["thread"] == t.metadata["pool"] == me
        for s in t.metadata["seen"]:
            assert s["header"] == me
            assert s["path"] == f"/rollouts/{me}/v1/chat/completions"
    assert tracerl.current_rollout() is None


async def test_progress_shows_mean_reward_metrics_and_takes_arts_bar_arguments(capsys):
    async def scored(reward, correct, length):
        await asyncio.sleep(0)
        return traj(reward, metrics={"correct": correct, "length": length})

    groups = await tracerl.gather_trajectory_groups(
        [tracerl.TrajectoryGroup([scored(1.0, True, 10), scored(0.0, False, 30)])],
        pbar_desc=None, pbar_total_completion_tokens=True, max_metrics=1)
    assert [t.reward for t in groups[0]] == [1.0, 0.0]
    bar = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    assert "reward=0.500" in bar and "correct=0.5" in bar
    assert "length" not in bar  # max_metrics=1 shows the first metric only
