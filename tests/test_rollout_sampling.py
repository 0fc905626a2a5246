"""Dynamic sampling (DAPO): groups with equal rewards are set aside and more are drawn until a
step has the groups with signal it asks for, within a bound of draws and time; the counts are
logged with the step. The draw logic is tested on scripted rollouts; the sync loop
(``gather_trajectory_groups`` + ``model.train``), ``RolloutPipeline``, ``train_task`` and the
rollout API run on the real transformers engine and trainer (SmolLM2)."""

from __future__ import annotations

import asyncio
import logging
import math
from collections import Counter
from collections.abc import Iterator

import httpx2
import pytest

import tracerl
from tracerl.core.errors import ConfigError
from tracerl.core.storage import read_jsonl
from tracerl.core.trajectory import read_groups_jsonl
from tracerl.rollout.sampling import SampledGroups, verdict
from tracerl.tasks.base import Item, Task, lora_config_for
from tracerl.tasks.runner import train_task

FAST = tracerl.TrainConfig(learning_rate=1e-3, seed=0)
CONFIG = tracerl.ModelConfig(engine=tracerl.EngineConfig(max_model_len=256))


def is_flat(i: int) -> bool:
    """Scenario ``i``'s group has equal rewards (every third one)."""
    return i % 3 == 0


def scripted_group(i: int, size: int = 2) -> tracerl.TrajectoryGroup:
    """A fixed group for scenario ``i``: ``size`` answers, rewards equal when ``is_flat(i)``,
    else 0, 1, 0, ... (no sampling involved)."""
    return tracerl.TrajectoryGroup([
        tracerl.Trajectory(reward=1.0 if is_flat(i) else float(k % 2), metadata={"scenario": i},
                           messages_and_choices=[
                               {"role": "user", "content": f"Is {i} even?"},
                               {"index": 0, "finish_reason": "stop",
                                "message": {"role": "assistant", "content": f"answer {k}"}}])
        for k in range(size)])


async def scripted(i: int, k: int) -> tracerl.Trajectory:
    await asyncio.sleep(0)  # yield once, as a real rollout would
    return scripted_group(i, k + 1).trajectories[k]


def source(n: int | None = None, size: int = 2) -> Iterator[tracerl.TrajectoryGroup]:
    """Pending groups of scenarios 0, 1, ... (``n`` of them, or without end)."""
    i = 0
    while n is None or i < n:
        yield tracerl.TrajectoryGroup(scripted(i, k) for k in range(size))
        i += 1


def scenarios(groups) -> list[int]:
    return [g.trajectories[0].metadata["scenario"] for g in groups]


async def test_equal_groups_are_set_aside_and_replaced_in_draw_order():
    groups = await tracerl.gather_trajectory_groups(
        source(), dynamic_sampling=tracerl.DynamicSampling(groups=3), show_progress=False)
    assert isinstance(groups, SampledGroups)
    assert scenarios(groups) == [1, 2, 4]  # the first three with signal; 0 and 3 set aside
    report = groups.sampling
    assert scenarios(report.discarded) == [0, 3]
    assert report.metrics() == pytest.approx({
        "groups_asked": 3, "groups_drawn": 5, "groups_kept": 3, "groups_discarded": 2,
        "groups_equal_rewards": 2, "groups_too_few_rollouts": 0, "rollouts_drawn": 10,
        "draw_seconds": report.seconds, "bound_hit": 0})


async def test_without_it_the_gather_is_ARTs():
    groups = await tracerl.gather_trajectory_groups(source(4), show_progress=False)
    assert type(groups) is list and scenarios(groups) == [0, 1, 2, 3]


@pytest.mark.parametrize(("rewards", "tolerance", "expected"), [
    ((0.5, 0.5 + 1e-9), 1e-6, "equal_rewards"), ((0.0, 0.1), 1e-6, "kept"),
    ((0.0, 0.1), 0.2, "equal_rewards"), ((1.0,), 0.0, "too_few_rollouts"),
])
def test_equal_means_within_the_tolerance(rewards, tolerance, expected):
    group = tracerl.TrajectoryGroup([
        tracerl.Trajectory(reward=r, messages_and_choices=[{"role": "user", "content": "x"}])
        for r in rewards])
    assert verdict(group, tolerance) == expected


async def test_the_draw_bound_trains_what_it_has_and_warns_naming_the_fix(caplog):
    def flat_then_one() -> Iterator[tracerl.TrajectoryGroup]:
        for i in (0, 1, 3, 6, 9, 12, 15):  # 0 and 1 drawn first; then only flat ones
            yield tracerl.TrajectoryGroup(scripted(i, k) for k in range(2))

    caplog.set_level(logging.WARNING, logger="tracerl.rollout.sampling")
    groups = await tracerl.gather_trajectory_groups(
        flat_then_one(), dynamic_sampling=tracerl.DynamicSampling(groups=2, max_draw_factor=2.5),
        show_progress=False)
    assert scenarios(groups) == [1]  # ceil(2.5 x 2) = 5 drawn: 0, 1, 3, 6, 9
    assert groups.sampling.metrics()["groups_drawn"] == 5
    assert groups.sampling.bound == "draws"
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "1 of 2 groups with signal after 5 drawn" in warning
    assert "max_draw_factor=2.5" in warning and "4 groups had equal rewards (4 at 1)" in warning
    # all set aside at the highest reward seen: the items are too easy
    for fix in ("larger groups", "higher temperature", "harder items", "max_draw_factor"):
        assert fix in warning


async def test_with_nothing_kept_the_step_gets_the_set_aside_groups():
    flat = (tracerl.TrajectoryGroup(scripted(3 * i, k) for k in range(2)) for i in range(9))
    groups = await tracerl.gather_trajectory_groups(
        flat, dynamic_sampling=tracerl.DynamicSampling(groups=2), show_progress=False)
    assert scenarios(groups) == [0, 3, 6, 9, 12, 15]  # trained, nothing learnt, counted
    assert groups.sampling.metrics()["groups_discarded"] == 0
    assert groups.sampling.metrics()["groups_equal_rewards"] == 6


async def test_the_time_bound_stops_replacements_not_the_first_draw():
    groups = await tracerl.gather_trajectory_groups(
        source(), dynamic_sampling=tracerl.DynamicSampling(groups=3, max_seconds=1e-9),
        show_progress=False)
    assert scenarios(groups) == [1, 2]
    assert (groups.sampling.bound, groups.sampling.drawn) == ("time", 3)


async def test_a_source_that_runs_out_is_a_bound():
    groups = await tracerl.gather_trajectory_groups(
        source(4), dynamic_sampling=tracerl.DynamicSampling(groups=3), show_progress=False)
    assert scenarios(groups) == [1, 2]
    assert groups.sampling.bound == "exhausted"


async def test_a_group_left_with_one_rollout_is_set_aside():
    async def fail() -> tracerl.Trajectory:
        raise ValueError("boom")

    def groups() -> Iterator[tracerl.TrajectoryGroup]:
        yield tracerl.TrajectoryGroup([scripted(1, 0), fail()])
        yield from source(3)

    out = await tracerl.gather_trajectory_groups(
        groups(), dynamic_sampling=tracerl.DynamicSampling(groups=2), max_exceptions=1,
        show_progress=False)
    assert scenarios(out) == [1, 2]
    assert out.sampling.metrics()["groups_too_few_rollouts"] == 1


async def test_gather_needs_the_groups_asked_for():
    with pytest.raises(ConfigError, match=r"dynamic_sampling\.groups"):
        await tracerl.gather_trajectory_groups(source(2),
                                               dynamic_sampling=tracerl.DynamicSampling())


def test_settings_are_checked_naming_the_field():
    for bad in ({"max_draw_factor": 0.5}, {"tolerance": -1}, {"groups": 0},
                {"max_seconds": 0}, {"max_draws": 2}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            tracerl.DynamicSampling(**bad)


# --- on the real engine and trainer ---------------------------------------------------------

async def new_model(backend, name: str) -> tracerl.TrainableModel:
    model = tracerl.TrainableModel(name=name, project="sampling", base_model="smollm2",
                                   config=CONFIG)
    await model.register(backend)
    return model


def history(backend, model, split: str) -> list[dict]:
    return [h for h in read_jsonl(backend.store(model).root / "history.jsonl")
            if h.get("split") == split]


async def test_the_sync_loop_trains_the_kept_groups_and_logs_the_draws(tf_backend):
    backend, _ = tf_backend
    model = await new_model(backend, "sync-ds")
    groups = await tracerl.gather_trajectory_groups(  # the one added argument
        source(), dynamic_sampling=tracerl.DynamicSampling(groups=2), show_progress=False)
    metrics = await model.train(groups, FAST)
    assert metrics["sampling/groups_kept"] == 2 and metrics["sampling/groups_discarded"] == 1
    assert metrics["groups"] == 2 and metrics["skipped_groups"] == 0
    store = backend.store(model)
    assert scenarios(read_groups_jsonl(store.trajectories_path("train", 1))) == [1, 2]
    assert scenarios(read_groups_jsonl(store.trajectories_path("discarded", 1))) == [0]
    (line,) = history(backend, model, "sampling")
    assert (line["step"], line["groups_drawn"], line["groups_equal_rewards"]) == (1, 3, 1)


async def test_the_pipeline_sets_aside_equal_groups_and_admits_others_instead(tf_backend):
    backend, _ = tf_backend
    model = await new_model(backend, "pipe-ds")

    async def rollout(model, scenario: int, config) -> tracerl.TrajectoryGroup:
        return scripted_group(scenario)

    pipeline = tracerl.RolloutPipeline(
        model, rollout, range(12), groups_per_step=2, max_steps_off_policy=0,
        train_config=FAST, dynamic_sampling=tracerl.DynamicSampling())
    trained = [t async for t in pipeline.steps(max_steps=3)]
    assert [scenarios(t.groups) for t in trained] == [[1, 2], [4, 5], [7, 8]]
    assert [t.discarded for t in trained] == [1, 1, 1]
    assert all(t.metrics["sampling/groups_kept"] == 2 for t in trained)
    lines = history(backend, model, "sampling")
    assert [(h["step"], h["groups_discarded"], h["bound_hit"]) for h in lines] == [
        (1, 1, 0), (2, 1, 0), (3, 1, 0)]
    discarded = read_groups_jsonl(backend.store(model).trajectories_path("discarded", 2))
    assert scenarios(discarded) == [3]


async def test_the_pipeline_trains_equal_groups_past_its_bound(tf_backend, caplog):
    backend, _ = tf_backend
    model = await new_model(backend, "pipe-bound")

    async def rollout(model, scenario: int, config) -> tracerl.TrajectoryGroup:
        return scripted_group(3 * scenario)  # every group flat

    caplog.set_level(logging.WARNING, logger="tracerl.rollout.sampling")
    pipeline = tracerl.RolloutPipeline(
        model, rollout, range(8), groups_per_step=2, max_steps_off_policy=0,
        train_config=FAST, dynamic_sampling=tracerl.DynamicSampling(max_draw_factor=2))
    (step,) = [t async for t in pipeline.steps(max_steps=1)]
    assert (step.discarded, len(step.groups)) == (2, 2)  # 2 set aside, then trained as they come
    assert step.metrics["sampling/bound_hit"] == 1
    assert any("0 of 2 groups with signal" in r.getMessage() for r in caplog.records)
    with pytest.raises(ConfigError, match=r"dynamic_sampling\.groups"):
        tracerl.RolloutPipeline(model, rollout, range(2), groups_per_step=2,
                                dynamic_sampling=tracerl.DynamicSampling(groups=3))


def flat_or_mixed_task() -> Task:
    """A task whose odd-numbered items reward every rollout 1 (no signal) and whose even ones
    reward a group's rollouts 0, 1, 0, ... in turn; each rollout makes one real call."""
    played: Counter[str] = Counter()

    def draw(seed: int, n: int) -> list[Item]:
        return [Item(f"item-{seed}-{i}", {"flat": i % 2 == 1}) for i in range(n)]

    async def rollout(model, item: Item, temperature: float = 1.0, step: int | None = None
                      ) -> tracerl.Trajectory:
        name = model.name if step is None else model.get_inference_name(step)
        r = await model.openai_client().chat.completions.create(
            model=name, messages=[{"role": "user", "content": item.key}], max_tokens=2,
            temperature=temperature)
        reward = 1.0 if item.data["flat"] else float(played[item.key] % 2)
        played[item.key] += 1
        return tracerl.Trajectory(
            reward=reward, metrics={"success": reward}, metadata={"item": item.key},
            messages_and_choices=[{"role": "user", "content": item.key}, r.choices[0]])

    return Task(name="flat-or-mixed", summary="", source="", framework="openai", draw=draw,
                rollout=rollout, model_config=lora_config_for(256), group_size=2,
                items_per_step=2)


async def test_train_task_trains_only_items_with_signal(tf_backend):
    backend, _ = tf_backend
    model = await new_model(backend, "task-ds")
    task = flat_or_mixed_task()
    run = await train_task(task, model, steps=1, eval_every=1, eval_n=1, config=FAST,
                           dynamic_sampling=tracerl.DynamicSampling())
    (sampling,) = run.sampling
    assert sampling["sampling/groups_kept"] == 2 and sampling["sampling/bound_hit"] == 0
    drawn = [i.key for i in task.items("train", math.ceil(2 * 3.0), seed=0 * 100_003 + 1)]
    # train items 1, 3 (flat), 4, 5 (flat), 6: two flat first, so two replacements, one flat
    assert drawn[:5] == [f"item-7919-{i}" for i in (1, 3, 4, 5, 6)]
    store = backend.store(model)
    saved = read_groups_jsonl(store.trajectories_path("train", 1))
    assert [g.trajectories[0].metadata["item"] for g in saved] == ["item-7919-4", "item-7919-6"]
    assert all(len(t.llm_calls) == 1 for g in saved for t in g.trajectories)  # real calls
    flat = read_groups_jsonl(store.trajectories_path("discarded", 1))
    assert [g.trajectories[0].metadata["item"] for g in flat] == [
        "item-7919-1", "item-7919-3", "item-7919-5"]
    assert all(len(t.llm_calls) == 1 for g in flat for t in g.trajectories)
    assert (sampling["sampling/groups_drawn"], sampling["sampling/groups_discarded"]) == (5, 3)


async def test_rollout_api_groups_with_equal_rewards_are_set_aside_and_reported(tf_backend):
    backend, _ = tf_backend
    model = await new_model(backend, "ext-ds")
    root = backend.base_url.removesuffix("/v1")
    async with httpx2.AsyncClient(base_url=root, timeout=120) as http:
        async def post_group(group: str, rewards: tuple[float, ...]) -> None:
            for reward in rewards:  # what an outside service does, rollout by rollout
                r = await http.post("/v1/rollouts", json={"model": "ext-ds", "group": group,
                                                          "group_size": len(rewards)})
                opened = r.json()
                chat = await http.post(
                    opened["base_url"].removeprefix(root) + "/chat/completions",
                    json={"model": "ext-ds", "max_tokens": 2,
                          "messages": [{"role": "user", "content": group}]})
                assert chat.status_code == 200, chat.text
                await http.post(f"/v1/rollouts/{opened['rollout_id']}/finish",
                                json={"reward": reward})

        for group, rewards in (("flat-a", (1, 1)), ("mixed-b", (0, 1)), ("mixed-c", (1, 0)),
                               ("flat-d", (0, 0))):
            await post_group(group, rewards)
        groups = await tracerl.gather_external_groups(
            model, 2, timeout_s=60, dynamic_sampling=tracerl.DynamicSampling())
        assert [g.metadata["group"] for g in groups] == ["mixed-b", "mixed-c"]
        assert [g.metadata["group"] for g in groups.sampling.discarded] == ["flat-a"]
        metrics = await model.train(groups, FAST)
        assert (metrics["sampling/groups_kept"], metrics["sampling/groups_discarded"]) == (2, 1)

        # only equal groups left: the wait for replacements is bounded, the client told
        await post_group("flat-e", (1, 1))
        out = await tracerl.gather_external_groups(
            model, 1, timeout_s=60, dynamic_sampling=tracerl.DynamicSampling(max_seconds=0.2))
    assert [g.metadata["group"] for g in out] == ["flat-d", "flat-e"]
    assert (out.sampling.bound, out.sampling.kept) == ("time", 0)
