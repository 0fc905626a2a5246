"""The async off-policy pipeline on the real transformers engine and trainer (SmolLM2): the
staleness bound holds for every trained call, a group past it is dropped (``staleness="drop"``)
or kept by admission and pacing (``"admit"``), each step logs the lengths of kept and dropped
rollouts, with a bound of 0 the pipeline trains exactly what the synchronous loop trains, and
when ``steps()`` ends its rollouts in flight are cancelled, in the engine too."""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch
from safetensors.torch import load_file

import tracerl
from tracerl.backend.publishing import AdapterPublisher
from tracerl.core.trajectory import read_groups_jsonl

from .conftest import until

FAST = tracerl.TrainConfig(learning_rate=1e-3, seed=0)


def scripted_group(scenario: int) -> tracerl.TrajectoryGroup:
    """A fixed group for ``scenario``: two answers, one rewarded (no sampling involved)."""
    return tracerl.TrajectoryGroup([
        tracerl.Trajectory(reward=float(i == scenario % 2), messages_and_choices=[
            {"role": "user", "content": f"Is {scenario} even?"},
            {"index": 0, "finish_reason": "stop",
             "message": {"role": "assistant", "content": answer}}])
        for i, answer in enumerate(("yes", "no"))])


async def scripted_rollout(model, scenario: int, config) -> tracerl.TrajectoryGroup:
    return scripted_group(scenario)


async def new_model(backend, name: str, **engine) -> tracerl.TrainableModel:
    model = tracerl.TrainableModel(
        name=name, project="pipeline", base_model="smollm2", config=tracerl.ModelConfig(
            engine=tracerl.EngineConfig(**{"max_model_len": 256, **engine})))
    await model.register(backend)
    return model


def adapter(backend, model, step: int) -> dict[str, torch.Tensor]:
    path = backend.store(model).checkpoint_dir(step) / "adapter_model.safetensors"
    return load_file(str(path))


async def test_with_a_bound_of_0_async_and_sync_train_the_same_update(tf_backend):
    backend, _ = tf_backend
    sync, pipelined = await new_model(backend, "sync0"), await new_model(backend, "async0")
    torch.manual_seed(0)  # the same LoRA initialisation for both policies
    for step in range(2):
        await sync.train([scripted_group(2 * step), scripted_group(2 * step + 1)], FAST)
    torch.manual_seed(0)
    trainer = tracerl.PipelineTrainer(
        pipelined, backend, scripted_rollout, range(4), config=None, groups_per_step=2,
        max_steps_off_policy=0, train_config=FAST, eval_at_start=False)
    trained = await trainer.train()
    assert [t.step for t in trained] == [1, 2]
    assert [t.steps_off_policy for t in trained] == [[0, 0], [0, 0]]
    a, b = adapter(backend, sync, 2), adapter(backend, pipelined, 2)
    assert a.keys() == b.keys()
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6
    assert max(a[k].abs().max().item() for k in a if "lora_B" in k) > 0  # it did train


async def test_a_group_past_the_bound_is_dropped_not_trained(tf_backend):
    backend, _ = tf_backend
    model = await new_model(backend, "drop1")

    async def rollout(model, scenario: int, config) -> tracerl.TrajectoryGroup:
        if scenario == 0:  # a slow rollout: it ends only after two steps have been trained
            await wait_for_step(model, 2)
        return scripted_group(scenario)

    pipeline = tracerl.RolloutPipeline(model, rollout, range(4), groups_per_step=1,
                                       max_steps_off_policy=1, train_config=FAST,
                                       staleness="drop")
    trained = [t async for t in pipeline.steps(max_steps=3)]
    assert [t.step for t in trained] == [1, 2, 3]
    assert [t.dropped_stale for t in trained] == [0, 0, 1]
    assert all(lag <= 1 for t in trained for lag in t.steps_off_policy)
    prompts = [g.trajectories[0].messages_and_choices[0]["content"]
               for t in trained for g in t.groups]
    assert "Is 0 even?" not in prompts


async def wait_for_step(model, step: int) -> None:
    async def reached() -> bool:
        return await model.get_step() >= step

    await until(reached, f"step {step} trained", 300, 0.05)


async def test_the_staleness_bound_holds_for_every_trained_call(tf_backend, tmp_path):
    """Real sampled two-turn rollouts while the trainer trains; two versions resident, each
    published to a directory first and served from there."""
    backend, _ = tf_backend
    published = tmp_path / "shm"
    model = await new_model(backend, "stale1", resident_adapters=2, publish_dir=str(published))

    async def one(scenario: int, reward: float) -> tracerl.Trajectory:
        client = model.openai_client()
        messages = [{"role": "user", "content": f"Count to {scenario}."}]
        choices: list = []
        for _ in range(2):
            r = await client.chat.completions.create(
                model=model.name, messages=messages, max_tokens=4, temperature=1.0)
            choices.append(r.choices[0])
            messages = [*messages, r.choices[0].message.model_dump(exclude_none=True),
                        {"role": "user", "content": "Go on."}]
        return tracerl.Trajectory(reward=reward, messages_and_choices=[*messages[:1], choices[0]])

    async def rollout(model, scenario: int, config) -> tracerl.TrajectoryGroup:
        return await tracerl.TrajectoryGroup([one(scenario, 0.0), one(scenario, 1.0)])

    bound = 1
    pipeline = tracerl.RolloutPipeline(model, rollout, range(8), groups_per_step=2,
                                       max_steps_off_policy=bound, train_config=FAST)
    trained = [t async for t in pipeline.steps(max_steps=3)]
    assert [t.step for t in trained] == [1, 2, 3]
    # groups admitted at the start beside the first step's were sampled by version 0 and
    # trained later: off-policy, within the bound
    assert max(lag for t in trained for lag in t.steps_off_policy) == 1
    store = backend.store(model)
    for t in trained:
        saved = read_groups_jsonl(store.trajectories_path("train", t.step))
        calls = [c for g in saved for tr in g.trajectories for c in tr.llm_calls]
        assert len(calls) == 8  # 2 groups x 2 rollouts x 2 turns
        policy = t.step - 1  # the version the step trained from
        assert all(policy - c.adapter_step <= bound for c in calls), \
            [(t.step, c.adapter_step) for c in calls]
        by_rollout: dict[str, set[int]] = {}
        for c in calls:  # two versions resident: a rollout stays on its version
            by_rollout.setdefault(c.rollout_id, set()).add(c.adapter_step)
        assert all(len(v) == 1 for v in by_rollout.values())
    # older ones retired
    assert AdapterPublisher(str(published)).published("pipeline/stale1") == [2, 3]
    route = backend.gateway.models["pipeline/stale1"]
    assert route.versions == {s: published / "pipeline" / "stale1" / f"policy@{s}" for s in (2, 3)}


async def test_a_failing_rollout_fails_the_pipeline_with_its_error(tf_backend):
    backend, _ = tf_backend
    model = await new_model(backend, "fail1")

    async def rollout(model, scenario: int, config) -> tracerl.TrajectoryGroup:
        raise RuntimeError(f"scenario {scenario} broke")

    pipeline = tracerl.RolloutPipeline(model, rollout, range(2), groups_per_step=1)
    with pytest.raises(RuntimeError, match="scenario 0 broke"):
        await asyncio.wait_for(anext(pipeline.steps()), 60)


SLOW_S = 12.0  # a slow rollout's environment wait: longer than a training step here


async def sea_group(model, scenario: int) -> tracerl.TrajectoryGroup:
    """Every third scenario is slow: a longer sampled answer, then an environment wait of
    ``SLOW_S`` (a tool, an opponent); the others answer in two tokens and return."""
    slow = scenario % 3 == 0

    async def one(reward: float) -> tracerl.Trajectory:
        messages = [{"role": "user", "content": f"Tell me about the sea, {scenario}."}]
        r = await model.openai_client().chat.completions.create(
            model=model.name, messages=messages, max_tokens=12 if slow else 2, temperature=1.0)
        if slow:
            await asyncio.sleep(SLOW_S)
        return tracerl.Trajectory(reward=reward, messages_and_choices=[*messages, r.choices[0]])

    return await tracerl.TrajectoryGroup([one(0.0), one(1.0)])


async def run_sea(backend, name: str, staleness: str) -> tuple[list, list[dict]]:
    model = await new_model(backend, name, resident_adapters=2)
    pipeline = tracerl.RolloutPipeline(
        model, lambda m, s, c: sea_group(m, s), range(6), groups_per_step=1,
        max_steps_off_policy=1, train_config=FAST, staleness=staleness)
    trained = [t async for t in pipeline.steps()]
    return trained, await model.history()


def trained_scenarios(trained) -> list[int]:
    return sorted(int(g.trajectories[0].messages_and_choices[0]["content"].split(", ")[1][:-1])
                  for t in trained for g in t.groups)


async def test_drop_loses_slow_groups_and_admit_keeps_them_within_the_bound(tf_backend):
    """One slow rollout kind (scenarios 0 and 3) among fast ones, one group a step, bound 1.
    ``drop``: the slow group started beside the first step is two versions old when it ends,
    and is dropped (it is logged under ``dropped``). ``admit``: the trainer waits for a running
    group at its last chance, so every group is trained, none beyond the bound. Each step's
    ``pipeline`` line has the kept (and dropped) rollouts' lengths."""
    backend, _ = tf_backend
    dropping, history = await run_sea(backend, "sea_drop", "drop")
    dropped = sum(t.dropped_stale for t in dropping)
    assert dropped >= 1 and 0 not in trained_scenarios(dropping)
    assert all(lag <= 1 for t in dropping for lag in t.steps_off_policy)
    lines = [h for h in history if h["split"] == "pipeline"]
    assert [h["step"] for h in lines] == [t.step for t in dropping]
    assert sum(h["dropped_groups"] for h in lines) == dropped
    with_drops = [h for h in lines if h["dropped_groups"]]
    assert all(h["dropped_rollout_s"] >= SLOW_S and h["dropped_rollout_tokens"] > 0
               for h in with_drops), with_drops
    assert [h["split"] for h in history if h["step"] == with_drops[0]["step"]].count(
        "dropped") == 1  # the dropped group itself, saved
    for t in dropping:
        assert t.metrics["pipeline/kept_groups"] == len(t.groups)

    admitting, history = await run_sea(backend, "sea_admit", "admit")
    assert sum(t.dropped_stale for t in admitting) == 0
    assert trained_scenarios(admitting) == list(range(6))
    assert all(lag <= 1 for t in admitting for lag in t.steps_off_policy)
    lines = [h for h in history if h["split"] == "pipeline"]
    assert [h["step"] for h in lines] == [t.step for t in admitting]
    assert all(h["dropped_groups"] == 0 and "dropped_rollout_s" not in h for h in lines)
    kept_s = [h["kept_rollout_s"] for h in lines]
    assert max(kept_s) >= SLOW_S > min(kept_s)  # the slow groups were trained, and fast ones
    assert all(h["kept_rollout_tokens"] > 0 for h in lines)
    assert "dropped" not in {h["split"] for h in history}


COUNTING = "Count from 1 to 1000, one number per line."
LONG = 1500  # tokens: far more than the engine samples during one training step here


class Leftovers:
    """Rollouts that stay in flight: scenario 0 is a fixed group, returned once another
    group's call decodes in the engine; every other group has a rollout that samples ``LONG``
    tokens and one that waits on an environment that never answers. Each rollout notes its
    start and its cancellation."""

    def __init__(self, batcher) -> None:
        self.batcher = batcher
        self.never = asyncio.Event()
        self.started = 0
        self.cancelled = 0
        self.four_started = asyncio.Event()  # groups 1 and 2 (admitted after step 1) running

    async def one(self, model, calls: bool) -> tracerl.Trajectory:
        self.started += 1
        if self.started == 4:
            self.four_started.set()
        try:
            if calls:
                await model.openai_client().chat.completions.create(
                    model=model.name, messages=[{"role": "user", "content": COUNTING}],
                    max_tokens=LONG, temperature=0.0)
            await self.never.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        raise AssertionError("an environment that never answers answered")

    async def rollout(self, model, scenario: int, config) -> tracerl.TrajectoryGroup:
        if scenario == 0:
            await until(lambda: self.batcher.decoding, "a long call decoding", 120)
            return scripted_group(0)
        return await tracerl.TrajectoryGroup([self.one(model, True), self.one(model, False)])

    def engine_idle(self) -> bool:
        b = self.batcher
        return not (b.decoding or b._waiting or b._prefill or b.queue.qsize())


async def leftovers(backend, name: str) -> tuple[tracerl.RolloutPipeline, Leftovers]:
    model = await new_model(backend, name, max_model_len=2048, resident_adapters=2)
    rollouts = Leftovers(backend.gateway.models[model.spec.key].engine._batcher_impl)
    pipeline = tracerl.RolloutPipeline(model, rollouts.rollout, range(10), groups_per_step=1,
                                       max_steps_off_policy=1, train_config=FAST)
    return pipeline, rollouts


async def assert_all_stopped(pipeline, rollouts: Leftovers, before: set, caplog) -> None:
    """Nothing the pipeline started runs on, the engine drops the calls of the cancelled
    rollouts, and the pipeline said what it cancelled."""
    await asyncio.wait_for(pipeline.stopped.wait(), 60)
    pending = [t for t in asyncio.all_tasks() - before - {asyncio.current_task()}
               if not t.done()]
    assert not pending, pending
    assert rollouts.cancelled == 4  # groups 1 and 2, two rollouts each
    await until(rollouts.engine_idle, "the engine to drop the cancelled calls", 30)
    assert "cancelled 2 rollout group(s) in flight" in caplog.text


async def test_steps_ending_at_max_steps_cancels_the_rollouts_in_flight(tf_backend, caplog):
    """``steps(max_steps=1)`` returns while two groups are in flight (one call decoding, the
    other rollouts waiting on their environment): they are cancelled and awaited, and the
    engine stops generating for them."""
    caplog.set_level(logging.INFO, logger="tracerl.rollout.pipeline")
    backend, _ = tf_backend
    before = asyncio.all_tasks()
    pipeline, rollouts = await leftovers(backend, "left_max")
    async for trained in pipeline.steps(max_steps=1):
        assert trained.step == 1
        await asyncio.wait_for(rollouts.four_started.wait(), 60)
        assert rollouts.batcher.decoding  # the long call, still generating
    assert pipeline.stopped.is_set()  # at once: steps() returned
    await assert_all_stopped(pipeline, rollouts, before, caplog)


async def test_a_break_out_of_steps_cancels_the_rollouts_in_flight(tf_backend, caplog):
    """The consumer leaves its ``async for`` with ``break``: the loop closes the generator,
    which cancels what was in flight as ``max_steps`` does."""
    caplog.set_level(logging.INFO, logger="tracerl.rollout.pipeline")
    backend, _ = tf_backend
    before = asyncio.all_tasks()
    pipeline, rollouts = await leftovers(backend, "left_break")
    async for _ in pipeline.steps():
        await asyncio.wait_for(rollouts.four_started.wait(), 60)
        break
    await assert_all_stopped(pipeline, rollouts, before, caplog)
