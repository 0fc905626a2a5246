"""gather_trajectory_groups: order, failure budgets, timeouts, cancellation, after_each,
rollout context across tasks and threads, and the progress bar."""

import asyncio
import json
import time
from types import SimpleNamespace

import pytest

import tracerl
from tests.echo_server import EchoServer


def traj(reward=1.0, **kw):
    return tracerl.Trajectory(
        messages_and_choices=[{"role": "user", "content": "x"}], reward=reward, **kw
    )


async def ok(reward=1.0):
    return traj(reward)


async def fail(msg="boom"):
    await asyncio.sleep(0)  # yield once, as a real rollout would, before failing
    raise ValueError(msg)


async def hang():
    await asyncio.sleep(3600)  # the injected fault: a rollout that never finishes by itself


async def test_groups_come_back_in_input_order_when_later_groups_finish_first():
    done = [asyncio.Event() for _ in range(3)]
    finished = []

    async def rollout(r):
        if r + 1 < len(done):
            await done[r + 1].wait()  # group r finishes only after group r + 1 has
        finished.append(r)
        done[r].set()
        return traj(float(r))

    groups = await asyncio.wait_for(tracerl.gather_trajectory_groups(
        (tracerl.TrajectoryGroup(rollout(r) for _ in range(3)) for r in range(3)),
        show_progress=False), 30)
    assert (finished[0], finished[-1]) == (2, 0)  # they did finish in reverse
    assert [[t.reward for t in g] for g in groups] == [[0.0] * 3, [1.0] * 3, [2.0] * 3]


async def test_every_rollout_gets_its_own_rollout_id():
    groups = await tracerl.gather_trajectory_groups(
        [tracerl.TrajectoryGroup(ok() for _ in range(3)) for _ in range(3)], show_progress=False)
    ids = [t.rollout_id for g in groups for t in g]
    assert len(set(ids)) == 9 and all(i.startswith("ro-") for i in ids)


async def test_exceptions_within_budget_are_kept_in_group():
    (g,) = await tracerl.gather_trajectory_groups(
        [tracerl.TrajectoryGroup([ok(), fail("bad rollout"), ok()])], max_exceptions=1,
        show_progress=False)
    assert len(g.trajectories) == 2
    assert [(e.type, e.message) for e in g.exceptions] == [("ValueError", "bad rollout")]


async def test_too_many_exceptions_raise_and_name_the_first():
    with pytest.raises(
        tracerl.TooManyExceptionsError, match=r"2 of 3 rollouts failed.*ValueError: first"
    ):
        await tracerl.gather_trajectory_groups(
            [tracerl.TrajectoryGroup([fail("first"), fail("second"), ok()])], max_exceptions=1,
            show_progress=False)


async def test_a_fractional_max_exceptions_allows_that_share_of_all_rollouts():
    groups = [tracerl.TrajectoryGroup([ok(), ok(), ok(), ok(), fail()]) for _ in range(2)]
    out = await tracerl.gather_trajectory_groups(groups, max_exceptions=0.2, show_progress=False)
    assert [len(g.exceptions) for g in out] == [1, 1]


async def test_a_fractional_max_exceptions_refuses_more_than_that_share():
    with pytest.raises(tracerl.TooManyExceptionsError, match="2 of 5 rollouts failed"):
        await tracerl.gather_trajectory_groups(
            [tracerl.TrajectoryGroup([ok(), ok(), ok(), fail(), fail()])], max_exceptions=0.2,
            show_progress=False)


async def test_stuck_rollout_times_out_instead_of_hanging():
    started = time.monotonic()
    (g,) = await tracerl.gather_trajectory_groups(
        [tracerl.TrajectoryGroup([ok(), hang()])], max_exceptions=1, rollout_timeout=0.2,
        show_progress=False)
    assert time.monotonic() - started < 5
    (e,) = g.exceptions
    assert e.type == "RolloutTimeoutError" and "did not finish within 0.2 s" in e.message


async def test_failing_gather_cancels_the_other_rollouts():
    cancelled = asyncio.Event()

    async def slow():
        try:
            await hang()  # only cancelling ends it
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
    (e,) = g.exceptions
    assert "must return a tracerl.Trajectory, got dict" in e.message


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


async def test_after_each_can_split_a_group_into_several():
    async def split(group):
        return [tracerl.TrajectoryGroup([t]) for t in group.trajectories]

    out = await tracerl.gather_trajectory_groups(
        [tracerl.TrajectoryGroup([ok(1), ok(2)])], after_each=split, show_progress=False)
    assert [[t.reward for t in g] for g in out] == [[1.0], [2.0]]


async def test_awaiting_a_group_directly_keeps_all_exceptions():
    g = await tracerl.TrajectoryGroup([fail(), ok()])
    assert len(g.trajectories) == 1 and len(g.exceptions) == 1


async def test_gather_trajectories_flat():
    out = await tracerl.gather_trajectories([ok(1), ok(2)], show_progress=False)
    assert sorted(t.reward for t in out) == [1.0, 2.0]


@pytest.mark.parametrize("bad", [-1, -0.5, True], ids=["negative", "negative-fraction", "bool"])
async def test_max_exceptions_must_be_a_count_or_a_fraction(bad):
    rollout = ok()
    try:
        with pytest.raises(ValueError, match="max_exceptions"):
            await tracerl.gather_trajectory_groups([tracerl.TrajectoryGroup([rollout])],
                                                   max_exceptions=bad)
    finally:
        rollout.close()  # refused before it ran


# --- 200 concurrent rollouts through one shared client ---------------------------------------


@pytest.fixture(scope="module")
async def concurrent_rollouts():
    """200 rollouts; each records its id as seen from itself, a sub-task, a thread, an executor
    and the echo server (which reflects the path and rollout header the client sent)."""
    server = EchoServer()
    model = tracerl.Model(
        name="m", project="p", inference_base_url=server.url, inference_api_key="k"
    )
    client = model.openai_client()  # one shared client for all rollouts
    sync_client = model.sync_openai_client()
    pool = tracerl.ContextThreadPoolExecutor(max_workers=8)

    def rollout_id():
        return tracerl.current_rollout().rollout_id

    def sync_call():
        r = sync_client.chat.completions.create(
            model="s", messages=[{"role": "user", "content": "x"}])
        return json.loads(r.choices[0].message.content)

    async def rollout(i):
        seen = []
        for _ in range(2):
            await asyncio.sleep(0.001 * (i % 7))  # staggers the rollouts so calls interleave
            r = await client.chat.completions.create(
                model=f"m{i}", messages=[{"role": "user", "content": "hi"}]
            )
            seen.append(json.loads(r.choices[0].message.content))
        return traj(metadata={
            "me": rollout_id(),
            "seen": [*seen, await asyncio.wrap_future(pool.submit(sync_call))],
            "sub": await asyncio.create_task(asyncio.sleep(0, result=rollout_id())),
            "thread": await asyncio.to_thread(rollout_id),
            "pool": await asyncio.wrap_future(pool.submit(rollout_id)),
        })

    try:
        groups = await tracerl.gather_trajectory_groups(
            [tracerl.TrajectoryGroup(rollout(g * 20 + i) for i in range(20)) for g in range(10)],
            show_progress=False)
        after = tracerl.current_rollout()
    finally:
        server.close()
        pool.shutdown()
    return SimpleNamespace(trajectories=[t for g in groups for t in g], after=after)


async def test_200_concurrent_rollouts_get_200_distinct_ids(concurrent_rollouts):
    trajs = concurrent_rollouts.trajectories
    assert len(trajs) == 200 and len({t.rollout_id for t in trajs}) == 200


async def test_a_trajectory_carries_the_id_of_the_rollout_that_made_it(concurrent_rollouts):
    wrong = [t.rollout_id for t in concurrent_rollouts.trajectories
             if t.rollout_id != t.metadata["me"]]
    assert wrong == []


@pytest.mark.parametrize("where", ["sub", "thread", "pool"],
                         ids=["sub-task", "to-thread", "context-executor"])
async def test_the_rollout_context_follows_into(concurrent_rollouts, where):
    wrong = [t.rollout_id for t in concurrent_rollouts.trajectories
             if t.metadata[where] != t.rollout_id]
    assert wrong == []


async def test_each_request_carries_its_own_rollouts_header_and_path(concurrent_rollouts):
    wrong = []
    for t in concurrent_rollouts.trajectories:
        me = t.rollout_id
        seen = t.metadata["seen"]
        assert len(seen) == 3  # two async calls and one sync call from the executor
        wrong += [s for s in seen if (s["header"], s["path"])
                  != (me, f"/rollouts/{me}/v1/chat/completions")]
    assert wrong == []


async def test_no_rollout_context_leaks_out_of_the_gather(concurrent_rollouts):
    assert concurrent_rollouts.after is None


# --- the progress bar ----------------------------------------------------------------------


async def last_bar_line(capsys, **bar_arguments):
    async def scored(reward, correct, length):
        return traj(reward, metrics={"correct": correct, "length": length})

    await tracerl.gather_trajectory_groups(
        [tracerl.TrajectoryGroup([scored(1.0, True, 10), scored(0.0, False, 30)])],
        **bar_arguments)
    return capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]


async def test_progress_shows_the_mean_reward(capsys):
    assert "reward=0.500" in await last_bar_line(capsys)


async def test_progress_shows_the_mean_of_each_metric(capsys):
    bar = await last_bar_line(capsys)
    assert "correct=0.5" in bar and "length=20" in bar


async def test_progress_takes_arts_bar_arguments_and_max_metrics_limits_the_metrics(capsys):
    bar = await last_bar_line(capsys, pbar_desc=None, pbar_total_completion_tokens=True,
                              max_metrics=1)
    assert "correct=0.5" in bar and "length" not in bar
