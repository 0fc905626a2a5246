"""``train_task(..., off_policy=b)``: a catalog task trained through the async pipeline on the
real transformers engine and trainer (SmolLM2): bad settings are refused before anything runs,
held-out evaluations come at the synchronous loop's steps, every trained group comes from the
train split, and each step records how far off-policy it was; a step whose every rollout
raised stops the run, in either loop."""

from __future__ import annotations

import pytest

import tracerl
from tracerl.core.errors import ConfigError
from tracerl.core.storage import read_jsonl
from tracerl.core.trajectory import read_groups_jsonl
from tracerl.tasks import get_task, split_of, train_task

pytest.importorskip("reasoning_gym")


@pytest.mark.parametrize("field, value", [("off_policy", -1), ("off_policy", 1.5),
                                          ("off_policy", True), ("staleness", "late")])
async def test_bad_async_settings_are_refused_naming_the_field(field, value):
    """Refused before the model is touched: it is not even registered (touching it would raise
    another error)."""
    model = tracerl.TrainableModel(name="unregistered", project="tasks", base_model="smollm2")
    settings = {"off_policy": 1, field: value}
    with pytest.raises(ConfigError, match=field):
        await train_task(get_task("tool-products"), model, steps=1, **settings)


async def test_a_sleeping_engine_is_refused_before_the_base_evaluation(tf_backend):
    backend, _ = tf_backend
    task = get_task("tool-products")
    config = task.model_config()
    config.engine.sleep_during_training = True
    model = tracerl.TrainableModel(name="async-asleep", project="tasks", base_model="smollm2",
                                   config=config)
    await model.register(backend)
    with pytest.raises(ConfigError, match="sleep_during_training"):
        await train_task(task, model, steps=1, off_policy=1)
    assert not backend.store(model).history_path.exists()  # no evaluation ran


async def test_off_policy_trains_train_items_and_evaluates_at_the_sync_steps(tf_backend):
    backend, _ = tf_backend
    task = get_task("tool-products")
    config = task.model_config()
    config.engine.resident_adapters = 2  # off_policy + 1
    model = tracerl.TrainableModel(name="async-tool", project="tasks", base_model="smollm2",
                                   config=config)
    await model.register(backend)
    run = await train_task(task, model, steps=2, off_policy=1, eval_every=2, eval_n=2,
                           group_size=2, items_per_step=1,
                           config=tracerl.TrainConfig(learning_rate=1e-3, seed=0))
    assert await model.get_step() == 2
    assert sorted(run.evals) == [0, 2]  # base, every eval_every, the end: as the sync loop
    assert len(run.train_success) == len(run.pipeline) == 2
    assert all(p["pipeline/steps_off_policy_max"] <= 1 and p["pipeline/kept_groups"] >= 1
               for p in run.pipeline)
    assert 0 < run.eval_seconds < run.seconds
    assert run.train_seconds == pytest.approx(run.seconds - run.eval_seconds)
    store = backend.store(model)
    history = read_jsonl(store.history_path)
    assert [h["step"] for h in history if h.get("split") == "val"] == [0, 2]
    assert [h["step"] for h in history if h.get("split") == "pipeline"] == [1, 2]
    # the items the sync loop draws for steps 1-4 (the pipeline runs ahead of step 2)
    drawn = [i.key for s in range(1, 5) for i in task.items("train", 1, seed=s)]
    held_out = {i.key for i in task.items("test", 2, seed=0)}
    for step in (1, 2):
        trained = [t.metadata["item"] for g in read_groups_jsonl(
            store.trajectories_path("train", step)) for t in g.trajectories]
        assert trained and all(split_of(k) == "train" and k in drawn for k in trained), trained
        assert not held_out & set(trained)


def _task_failing_on(splits: set[str]):
    """The tool task with a rollout that raises (as a task needing a missing Node.js does) on
    the items of ``splits`` and plays nothing on the others (a reward-0 trajectory)."""
    import dataclasses

    from tracerl.core.trajectory import Trajectory

    async def rollout(model, item, temperature=1.0, step=None):
        if split_of(item.key) in splits:
            raise RuntimeError("the agent needs Node.js (node) on PATH")
        return Trajectory(messages_and_choices=[{"role": "user", "content": item.key}],
                          reward=0.0, metrics={"success": 0.0})

    return dataclasses.replace(get_task("tool-products"), rollout=rollout)


@pytest.mark.parametrize("off_policy", [None, 1])
async def test_a_step_whose_every_rollout_raised_stops_the_run_naming_the_error(
        tf_backend, off_policy):
    """Before, train_task went on through every step with nothing to train (on the GPU kit,
    20 steps of a task whose Node.js was missing) and reported success 0."""
    from tracerl.core.errors import TooManyExceptionsError

    backend, _ = tf_backend
    model = tracerl.TrainableModel(name=f"fails-on-train-{off_policy}", project="tasks",
                                   base_model="smollm2")
    await model.register(backend)
    with pytest.raises(TooManyExceptionsError,
                       match=r"step 1: all \d+ rollouts raised.*RuntimeError: the agent needs "
                             r"Node\.js"):
        await train_task(_task_failing_on({"train"}), model, steps=3, eval_n=2, group_size=2,
                         items_per_step=2, off_policy=off_policy)
    history = read_jsonl(backend.store(model).history_path)
    assert [h["step"] for h in history if h.get("split") == "val"] == [0]  # base held-out ran


async def test_a_base_evaluation_whose_every_rollout_raised_stops_before_training(tf_backend):
    from tracerl.core.errors import TooManyExceptionsError

    backend, _ = tf_backend
    model = tracerl.TrainableModel(name="fails-everywhere", project="tasks", base_model="smollm2")
    await model.register(backend)
    with pytest.raises(TooManyExceptionsError, match="base held-out: all 2 rollouts raised"):
        await train_task(_task_failing_on({"train", "test"}), model, steps=3, eval_n=2,
                         group_size=2, items_per_step=2)
    assert await model.get_step() == 0
    assert not backend.store(model).history_path.exists()
