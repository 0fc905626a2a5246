"""ART 0.5's API beside tracerl's: ``backend.train`` keyword arguments, ``model.log``, capture
scopes, ``retry``, ART's dataset order, ``strip_logprobs``, the SFT helpers and the type names.
Model-backed facts run on the shared transformers backend (SmolLM2)."""

from __future__ import annotations

import asyncio
import math
import time
from types import SimpleNamespace

import pytest
from openai.types.chat.chat_completion import Choice

import tracerl
import tracerl as art
from tracerl.core.art_compat import train_config_from_art_kwargs
from tracerl.core.trajectory import read_groups_jsonl
from tracerl.events import plugins
from tracerl.utils.sft import create_lr_schedule, create_sft_dataset_iterator, iterate_file
from tracerl.utils.strip_logprobs import strip_logprobs

from .remote_server import API_KEY, ServerProcess

# --- backend.train's keyword arguments -------------------------------------------------------

MAPPED = {
    "ppo with its clip range": ({"loss_fn": "ppo", "epsilon": 0.1, "epsilon_high": 0.3},
                                {"loss_fn": "ppo", "epsilon": 0.1, "epsilon_high": 0.3}),
    "ppo's default clip range": ({"loss_fn": "ppo"}, {"epsilon": 0.2, "epsilon_high": None}),
    "cispo by default": ({}, {"loss_fn": "cispo", "epsilon": 1.0, "epsilon_high": 4.0}),
    "kl coefficient": ({"kl_penalty_coef": 0.05}, {"beta": 0.05}),
    "no reward scaling": ({"normalize_advantages": False}, {"scale_rewards": False}),
    "scale_rewards": ({"scale_rewards": False}, {"scale_rewards": False}),
    "packed length": ({"packed_sequence_length": 2048}, {"micro_batch_tokens": 2048}),
    "tracerl's own fields": ({"max_grad_norm": 0.5, "seed": 3}, {"max_grad_norm": 0.5,
                                                                   "seed": 3}),
    "knobs with tracerl's meaning": ({"allow_training_without_logprobs": True, "verbose": True,
                                      "logprob_calculation_chunk_size": 64}, {}),
    "off values": ({"save_checkpoint": True, "advantage_balance": 0.0,
                    "importance_sampling_level": "token"}, {}),
}


@pytest.mark.parametrize("case", MAPPED, ids=list(MAPPED))
def test_arts_train_keywords_map_to_the_train_config(case):
    kwargs, expected = MAPPED[case]
    config = train_config_from_art_kwargs({"learning_rate": 2e-5, **kwargs})
    assert config.learning_rate == 2e-5
    assert {k: getattr(config, k) for k in expected} == expected


REFUSED = {
    "an unknown keyword": ({"lerning_rate": 1e-5}, "lerning_rate"),
    "a feature tracerl lacks": ({"advantage_balance": 0.5}, r"advantage_balance=0.5 \(only 0.0\)"),
    "skipping the checkpoint": ({"save_checkpoint": False}, "save_checkpoint=False"),
    "sequence-level importance sampling": ({"importance_sampling_level": "sequence"},
                                           "importance_sampling_level"),
    "another loss": ({"loss_fn": "dro"}, "loss_fn='dro'"),
    "a bad value": ({"learning_rate": -1.0}, "learning_rate"),
}


@pytest.mark.parametrize("case", REFUSED, ids=list(REFUSED))
def test_train_keywords_without_an_equivalent_are_named(case):
    kwargs, needle = REFUSED[case]
    with pytest.raises(tracerl.ConfigError, match=needle):
        train_config_from_art_kwargs(kwargs)


def test_every_refused_keyword_is_named_at_once():
    with pytest.raises(tracerl.ConfigError, match="foo, bar"):
        train_config_from_art_kwargs({"foo": 1, "bar": 2})


# --- ART's dataset order, from ART 0.5.18's own iterate_dataset ----------------------------

# (size, groups_per_step, num_epochs, initial_step) -> ART 0.5.18's batches, produced by running
# art/utils/iterate_dataset.py of the openpipe-art 0.5.18 wheel over list(range(size))
ART_BATCHES = {
    (7, 3, 2, 0): [(0, 0, 0, [4, 2, 1]), (1, 0, 1, [0, 5, 3]), (2, 0, 2, [6]),
                   (3, 1, 0, [3, 6, 5]), (4, 1, 1, [2, 0, 4]), (5, 1, 2, [1])],
    (10, 4, 3, 2): [(2, 0, 2, [9, 6]), (3, 1, 0, [6, 8, 9, 7]), (4, 1, 1, [5, 3, 0, 4]),
                    (5, 1, 2, [1, 2]), (6, 2, 0, [5, 9, 3, 4]), (7, 2, 1, [6, 7, 2, 8]),
                    (8, 2, 2, [1, 0])],
    (5, 2, 2, 3): [(3, 1, 0, [2, 3]), (4, 1, 1, [4, 0]), (5, 1, 2, [1])],
}


@pytest.mark.parametrize("args", ART_BATCHES, ids=[str(a) for a in ART_BATCHES])
def test_iterate_dataset_serves_arts_order(args):
    size, per_step, epochs, initial = args
    batches = art.utils.iterate_dataset(list(range(size)), per_step, epochs, initial,
                                        use_tqdm=False)
    assert [(b.step, b.epoch, b.epoch_step, b.items) for b in batches] == ART_BATCHES[args]


def test_arts_module_path_of_iterate_dataset():
    from tracerl.utils.iterate_dataset import iterate_dataset

    assert iterate_dataset is art.utils.iterate_dataset


# --- retry, strip_logprobs ------------------------------------------------------------------


def flaky(fails: int, error: type[Exception] = ConnectionError):
    calls = []

    def fn():
        calls.append(time.monotonic())
        if len(calls) <= fails:
            raise error(f"failure {len(calls)}")
        return len(calls)

    return fn, calls


def test_retry_calls_again_until_it_succeeds():
    fn, calls = flaky(2)
    retried = []
    wrapped = art.retry(max_attempts=3, delay=0.05, backoff_factor=3.0,
                        on_retry=lambda e, n: retried.append(n))(fn)
    assert wrapped() == 3 and retried == [1, 2]
    assert calls[1] - calls[0] >= 0.05 and calls[2] - calls[1] >= 0.15  # waits grow


def test_retry_gives_up_after_max_attempts_with_the_last_error():
    fn, calls = flaky(5)
    with pytest.raises(ConnectionError, match="failure 2"):
        art.retry(max_attempts=2, delay=0)(fn)()
    assert len(calls) == 2


def test_retry_lets_other_exceptions_through_at_once():
    fn, calls = flaky(1, KeyError)
    with pytest.raises(KeyError):
        art.retry(exceptions=(ConnectionError,), delay=0)(fn)()
    assert len(calls) == 1


def test_retry_wraps_async_functions():
    attempts = []

    @art.retry(max_attempts=3, delay=0)
    async def fetch():
        attempts.append(1)
        if len(attempts) < 3:
            raise TimeoutError
        return "ok"

    assert asyncio.run(fetch()) == "ok" and len(attempts) == 3


def test_strip_logprobs_removes_them_at_any_depth_and_leaves_the_input():
    choice = Choice.model_validate({"index": 0, "finish_reason": "stop", "logprobs": {
        "content": []}, "message": {"role": "assistant", "content": "hi"}})
    data = {"logprobs": [1], "choices": [{"logprobs": 2, "text": "a"}], "obj": choice}
    stripped = strip_logprobs(data)
    assert stripped["choices"] == [{"text": "a"}] and "logprobs" not in stripped
    assert stripped["obj"].logprobs is None and stripped["obj"].message.content == "hi"
    assert data["choices"][0]["logprobs"] == 2 and choice.logprobs is not None


# --- the data model: ART's names, finish/track_duration, group metrics ----------------------


def test_arts_type_names_are_exported():
    assert art.TrainResult(step=1).metrics == {}
    assert art.LocalTrainResult(1, {}, "/x").checkpoint_path == "/x"
    assert art.LoRAConfig is art.dev.LoRAConfig and issubclass(art.Backend, object)
    assert {"Messages", "MessagesAndChoices", "Tools"} <= set(art.__all__)
    from tracerl.local.backend import LocalBackend

    assert LocalBackend is art.LocalBackend


async def test_track_duration_adds_up_each_block():
    t = art.Trajectory()
    for _ in range(2):
        async with t.track_duration("tool"):
            await asyncio.sleep(0.01)
    assert t.metrics["tool_duration"] >= 0.02


def test_finish_stamps_the_duration():
    t = art.Trajectory(start_time=time.time() - 2)
    assert t.finish() is t and t.metrics["duration"] >= 2 and t.end_time is not None


def test_a_group_carries_metrics_and_logs_through_json():
    g = art.TrajectoryGroup([art.Trajectory(reward=1)], metrics={"judge_ok": True})
    g.log("judged")
    again = art.TrajectoryGroup.from_json(g.model_dump_json())
    assert (again.metrics, again.logs) == ({"judge_ok": 1.0}, ["judged"])


def test_capture_scope_makes_the_trajectory_current_and_hides_it_in_no_capture():
    assert art.current_trajectory() is None
    with art.Trajectory() as outer:
        assert art.current_trajectory() is outer and tracerl.current_rollout() is outer.scope
        with art.no_capture():
            assert art.current_trajectory() is None and tracerl.current_rollout() is None
            with art.Trajectory() as inner:
                assert art.current_trajectory() is inner
        assert art.current_trajectory() is outer
    assert outer.rollout_id == outer.scope.rollout_id != inner.rollout_id
    assert "duration" in outer.metrics


def test_current_trajectory_required_outside_a_scope_says_where_to_call_it():
    with pytest.raises(RuntimeError, match="with Trajectory"):
        art.current_trajectory(require=True)
    with pytest.raises(RuntimeError, match="capture_auto_trajectory"):
        art.auto_trajectory(required=True)


def test_yield_trajectory_outside_its_capture_is_refused():
    with pytest.raises(RuntimeError, match="capture_yielded_trajectory"):
        art.yield_trajectory(art.Trajectory())


async def test_a_captured_coroutine_that_yields_nothing_is_refused():
    async def agent():
        return None

    with pytest.raises(RuntimeError, match="No trajectory yielded"):
        await art.capture_yielded_trajectory(agent())


async def test_trajectory_takes_a_coroutine_not_a_task():
    async def agent():
        return None

    task = asyncio.ensure_future(agent())
    with pytest.raises(TypeError, match="coroutine"):
        await art.trajectory(task)
    await task


# --- SFT helpers ------------------------------------------------------------------------------


def test_lr_schedules_warm_up_then_decay_to_the_floor():
    assert create_lr_schedule(4, 1.0, "linear", warmup_steps=1) == pytest.approx(
        [1.0, 1.0, 0.5, 0.0])
    assert create_lr_schedule(3, 1.0, "cosine") == pytest.approx([1.0, 0.5, 0.0])
    assert create_lr_schedule(2, 0.3, "constant", min_lr=0.1) == [0.3, 0.3]
    assert create_lr_schedule(0, 1.0) == []


def test_sft_dataset_chunks_slice_one_schedule_over_all_batches():
    items = [art.Trajectory(messages_and_choices=[{"role": "user", "content": str(i)}])
             for i in range(5)]
    chunks = list(create_sft_dataset_iterator(items, chunk_size=2, batch_size=2, epochs=1,
                                              peak_lr=1.0, warmup_ratio=0.0))
    assert [(c.step, len(c.trajectories)) for c in chunks] == [(0, 4), (2, 1)]
    assert [c.config.learning_rate for c in chunks] == [pytest.approx([1.0, 0.5]), [0.0]]


def test_iterate_file_streams_every_row_each_epoch_and_names_a_bad_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(
        f'{{"messages": [{{"role": "user", "content": "{i}"}}]}}\n' for i in range(4)))
    seen = [t.messages()[0]["content"] for t in iterate_file(path, epochs=2,
                                                             shuffle_buffer_size=2)]
    assert sorted(seen[:4]) == sorted(seen[4:]) == ["0", "1", "2", "3"]
    path.write_text('{"messages": []}\n')
    with pytest.raises(tracerl.InvalidTrajectoryError, match=r"d.jsonl:1: needs a non-empty"):
        list(iterate_file(path))


def test_sft_config_refuses_bad_values():
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        art.TrainSFTConfig(batch_size=0)
    with pytest.raises(ValueError, match="learning_rate must be in"):
        art.TrainSFTConfig(learning_rate=[])


# --- on the shared backend: positional config, capture scopes, model.log, sync with ---------


async def say(model, text: str, max_tokens: int = 4):
    return await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), max_tokens=max_tokens,
        messages=[{"role": "user", "content": text}])


@pytest.fixture(scope="module")
async def scoped(tf_backend):
    """Capture scopes on a served model, then one ``backend.train`` on what they captured."""
    backend, _ = tf_backend
    model = art.TrainableModel(name="scopes", project="art-api", base_model="smollm2",
                               config=art.ModelConfig(engine=art.EngineConfig(max_model_len=256)))
    await model.register(backend)

    async def agent(reward: float):
        await say(model, "Hi")
        art.current_trajectory(require=True).reward = reward

    async def old_style(reward: float):
        await say(model, "Hello")
        art.auto_trajectory(required=True).reward = reward

    async def yielding(reward: float):
        await say(model, "Hey")
        art.yield_trajectory(art.Trajectory(reward=reward, metadata={"kind": "yielded"}))

    async def failing():
        await say(model, "Bye")
        raise ValueError("tool broke")

    with art.Trajectory(reward=0.5) as by_with:
        await say(model, "Yo")
        with art.no_capture():
            await say(model, "not mine")
    group = await art.trajectory_group(
        [art.trajectory(agent(1.0)), art.capture_auto_trajectory(old_style(0.0)),
         art.capture_yielded_trajectory(yielding(0.25)), by_with,
         art.trajectory(failing())],
        metrics={"group_metric": 2.0}, logs=["built"], return_exceptions=True)
    batches = [b async for b in art.trajectory_group_batches(
        [art.trajectory_group([art.trajectory(agent(float(i))) for i in range(2)])
         for _ in range(3)], batch_size=2, show_progress=False)]
    try:
        await backend.train(model, [group], tracerl.TrainConfig())
    except tracerl.ConfigError as e:
        positional_error = str(e)
    result = await backend.train(model, [group], learning_rate=1e-5)
    return SimpleNamespace(model=model, group=group, batches=batches, result=result,
                           positional_error=positional_error, store=backend.store(model))


async def test_each_scope_captures_its_own_calls(scoped):
    prompts = [[c.request["messages"][-1]["content"] for c in t.llm_calls] for t in scoped.group]
    assert prompts == [["Hi"], ["Hello"], ["Hey"], ["Yo"]]


async def test_rewards_set_through_the_current_trajectory_are_kept(scoped):
    assert [t.reward for t in scoped.group] == [1.0, 0.0, 0.25, 0.5]
    assert scoped.group.trajectories[2].metadata == {"kind": "yielded"}


async def test_a_failed_rollout_is_kept_as_the_groups_exception(scoped):
    (exc,) = scoped.group.exceptions
    assert (exc.type, exc.message) == ("ValueError", "tool broke")
    assert (scoped.group.metrics, scoped.group.logs) == ({"group_metric": 2.0}, ["built"])


async def test_messages_come_from_the_last_recorded_call(scoped):
    first = scoped.group.trajectories[0].messages()
    assert first[0] == {"role": "user", "content": "Hi"} and first[1]["role"] == "assistant"


async def test_trajectory_group_batches_yields_full_batches_then_the_rest(scoped):
    assert [len(b) for b in scoped.batches] == [2, 1]


async def test_a_positional_config_points_at_the_keyword_form(scoped):
    assert "not a positional TrainConfig" in scoped.positional_error
    assert "learning_rate=" in scoped.positional_error and "model.train(groups" in (
        scoped.positional_error)


async def test_backend_train_trains_the_captured_tokens(scoped):
    assert scoped.result.step == 1 and scoped.result.metrics["rendered_rows"] == 0
    assert scoped.result.metrics["trained_tokens"] > 0


async def test_backend_train_logs_nothing_beyond_the_steps_record(scoped):
    lines = [h for h in await scoped.model.history() if h["step"] == 1]
    assert [h["split"] for h in lines] == ["train"]  # the trainer's line, no model.log line


@pytest.fixture(scope="module")
async def logged(scoped):
    model, group = scoped.model, scoped.group
    await model.log(metrics={"eval/accuracy": 0.75}, step=7, split="val")
    await model.log([group], split="val")
    await model.log(list(group.trajectories), split="val", metrics={"extra": 1.0})
    await model.log([group], split="train", step=1)  # the step saved these already
    return SimpleNamespace(history=await model.history(), store=scoped.store)


async def test_model_log_of_metrics_only_writes_a_line_at_the_given_step(logged):
    (line,) = [h for h in logged.history if h["step"] == 7]
    assert line["eval/accuracy"] == 0.75 and "reward" not in line
    assert not logged.store.trajectories_path("val", 7).exists()


async def test_model_log_defaults_to_the_current_step(logged):
    val = [h for h in logged.history if h["split"] == "val" and h["step"] == 1]
    assert [h["num_trajectories"] for h in val] == [4.0, 4.0] and val[1]["extra"] == 1.0


async def test_logging_groups_a_step_saved_does_not_duplicate_them(logged):
    assert len(read_groups_jsonl(logged.store.trajectories_path("train", 1))) == 1
    assert len(read_groups_jsonl(logged.store.trajectories_path("val", 1))) == 2


async def test_model_log_averages_group_metrics(logged):
    val = [h for h in logged.history if h["split"] == "val" and h["step"] == 1]
    assert val[0]["group_metrics/group_metric"] == 2.0


async def test_model_log_needs_something_to_log(scoped):
    with pytest.raises(tracerl.InvalidTrajectoryError, match="metrics="):
        await scoped.model.log()
    with pytest.raises(tracerl.InvalidTrajectoryError, match="metrics="):
        await scoped.model.log([])


async def test_model_log_of_no_trajectories_with_metrics_logs_the_metrics(scoped):
    """As ART (a judge that dropped every group leaves ``[]``): the metrics are logged.
    Before, ``model.log([], metrics=...)`` raised."""
    summary = await scoped.model.log([], metrics={"judge/dropped": 4.0}, step=9, split="train")
    assert summary == {"judge/dropped": 4.0}
    (line,) = [h for h in await scoped.model.history() if h["step"] == 9]
    assert line["split"] == "train" and line["judge/dropped"] == 4.0
    assert not scoped.store.trajectories_path("train", 9).exists()


@pytest.mark.parametrize("field", ["step", "split", "time"])
async def test_a_metric_named_like_a_history_field_is_refused_before_anything_is_written(
        scoped, field):
    """A metric ``step`` overwrote the line's step (the line landed at another step)."""
    model, group = scoped.model, scoped.group
    store = model.backend.store(model.spec)
    before = await model.history()
    with pytest.raises(tracerl.InvalidTrajectoryError, match=rf"metrics\['{field}'\]"):
        await model.log([group], split="refused", metrics={field: 3.0}, step=40)
    with pytest.raises(tracerl.InvalidTrajectoryError, match=rf"metrics\['{field}'\]"):
        await model.backend.log(model.spec, [group], "refused", 40, {field: 3.0})
    assert await model.history() == before
    assert not store.trajectories_path("refused", 40).exists()


class HookRecorder:
    """A plugin that notes which step and logging hooks fire."""

    def __init__(self):
        self.fired: list[tuple[str, str | int]] = []

    @tracerl.hookimpl
    def tracerl_after_train_step(self, model, step, metrics):
        self.fired.append(("after_train_step", step))

    @tracerl.hookimpl
    def tracerl_log_metrics(self, model, step, split, metrics):
        self.fired.append(("log_metrics", split))


async def test_backend_train_fires_the_step_hooks_and_leaves_logging_to_model_log(tf_backend):
    """As in ART: ``backend.train`` does not log, ``model.log`` and ``model.train_sft`` do."""
    backend, _ = tf_backend
    model = art.TrainableModel(name="hooks", project="art-api", base_model="smollm2",
                               config=art.ModelConfig(engine=art.EngineConfig(max_model_len=256)))
    await model.register(backend)
    groups = [art.TrajectoryGroup([art.Trajectory(
        messages_and_choices=[{"role": "user", "content": "a"},
                              {"role": "assistant", "content": "b"}], reward=r)
        for r in (0.0, 1.0)])]
    recorder = HookRecorder()
    name = plugins.register(recorder, name="art-hook-recorder")
    try:
        result = await backend.train(model, groups, learning_rate=1e-5)
        trained = list(recorder.fired)
        await model.log(groups, metrics=result.metrics, step=result.step, split="train")
        logged = list(recorder.fired)
        await model.train_sft(groups[0].trajectories)
    finally:
        plugins.get_plugin_manager().unregister(name=name)
    assert trained == [("after_train_step", 1)]
    assert logged == [("after_train_step", 1), ("log_metrics", "train")]
    assert recorder.fired[2:] == [("log_metrics", "train")]  # the SFT step's metrics


def test_sync_with_closes_the_backend(tmp_path):
    with art.LocalBackend(path=tmp_path, engine="transformers") as backend:
        assert backend.base_url.startswith("http://127.0.0.1:") and backend.serving
    assert not backend.serving


async def test_sync_with_inside_async_code_closes_the_backend(tmp_path):
    with art.LocalBackend(path=tmp_path, engine="transformers") as backend:
        assert backend.base_url and backend.serving  # the gateway starts on first use
    assert not backend.serving


# --- RemoteBackend.train: the same keywords over HTTP ---------------------------------------


@pytest.fixture(scope="module")
async def remote_step(tmp_path_factory):
    server = ServerProcess(tmp_path_factory.mktemp("art-remote")).start()
    backend = art.RemoteBackend(server.url, api_key=API_KEY)
    try:
        model = art.TrainableModel(
            name="remote-art", project="art-api", base_model="smollm2",
            config=art.ModelConfig(engine=art.EngineConfig(max_model_len=256)))
        await model.register(backend)
        group = await art.trajectory_group(
            [art.trajectory(_remote_agent(model, r)) for r in (0.0, 1.0)])
        result = await backend.train(model, [group], learning_rate=1e-5, loss_fn="ppo")
        await model.log([group], metrics=result.metrics, step=result.step, split="train")
        try:
            await backend.train(model, [group], kimi_k2_tau=0.5)
        except tracerl.ConfigError as e:
            refused = str(e)
        try:
            await model.train_sft(group.trajectories)
        except tracerl.TrainingError as e:
            no_sft = str(e)
        history = await model.history()
        return SimpleNamespace(result=result, history=history, refused=refused, no_sft=no_sft,
                               step=await model.get_step())
    finally:
        await backend.close()
        server.stop()


async def _remote_agent(model, reward):
    await say(model, "Hi")
    art.current_trajectory(require=True).reward = reward


async def test_remote_backend_train_returns_the_step_and_metrics(remote_step):
    assert isinstance(remote_step.result, art.TrainResult) and remote_step.result.step == 1
    assert remote_step.result.metrics["trained_tokens"] > 0 and remote_step.step == 1


async def test_remote_backend_train_refuses_before_sending(remote_step):
    assert "kimi_k2_tau=0.5" in remote_step.refused and remote_step.step == 1


async def test_remote_model_log_writes_at_the_given_step(remote_step):
    assert [(h["split"], h["step"]) for h in remote_step.history] == [("train", 1)] * 2


# --- ART's default loss -----------------------------------------------------------------------


def test_cispo_gradient_is_the_clipped_weight_times_the_advantage_times_grad_logp():
    """CISPO (ART 0.5's default): d loss / d logp = -clip(r, 1 - eps, 1 + eps_high) * A, the
    weight held constant, where PPO's clipped tokens get no gradient at all."""
    import torch

    from tracerl.backend.training.loss import grpo_per_token_loss

    old = torch.zeros(1, 3)
    adv = torch.tensor([2.0])
    grads = {}
    for loss_fn in ("cispo", "ppo"):
        logp = torch.tensor([[0.0, 0.5, -0.5]], requires_grad=True)  # r = 1, e^0.5, e^-0.5
        loss, _ = grpo_per_token_loss(logp, old, adv, epsilon=0.2, epsilon_high=0.2,
                                      loss_fn=loss_fn)
        loss.sum().backward()
        grads[loss_fn] = logp.grad[0].tolist()
    assert grads["cispo"] == pytest.approx([-2.0, -2.0 * 1.2, -2.0 * 0.8])
    assert grads["ppo"] == pytest.approx([-2.0, 0.0, -2.0 * math.exp(-0.5)])


async def test_remote_sft_is_refused_naming_where_it_runs(remote_step):
    assert "RemoteBackend has no supervised fine-tuning" in remote_step.no_sft
    assert "LocalBackend" in remote_step.no_sft and remote_step.step == 1


# --- SFT rows: the loss is on the assistant tokens only --------------------------------------


def test_sft_rows_train_each_assistant_turn_and_nothing_else(tokenizer):
    from tracerl.backend.training.sft import sft_rows

    trajectory = art.Trajectory(messages_and_choices=[
        {"role": "user", "content": "Capital of Victoria?"},
        {"role": "assistant", "content": "Melbourne"},
        {"role": "user", "content": "And of Queensland?"},
        Choice.model_validate({"index": 0, "finish_reason": "stop",
                               "message": {"role": "assistant", "content": "Brisbane"}})])
    (row,) = sft_rows(tokenizer, trajectory)
    trained = tokenizer.decode([t for t, m in zip(row.input_ids, row.loss_mask, strict=True) if m])
    context = tokenizer.decode([t for t, m in zip(row.input_ids, row.loss_mask, strict=True)
                                if not m])
    assert trained == "Melbourne<|im_end|>\nBrisbane<|im_end|>\n"
    assert "Capital of Victoria?" in context and "And of Queensland?" in context
    full = tokenizer.apply_chat_template(trajectory.messages(), tokenize=False)
    assert tokenizer.decode(row.input_ids) == full  # one row: the whole conversation, as served


def test_a_conversation_without_an_assistant_turn_gives_no_row(tokenizer):
    from tracerl.backend.training.sft import sft_rows

    assert sft_rows(tokenizer, art.Trajectory(
        messages_and_choices=[{"role": "user", "content": "hi"}])) == []


@pytest.mark.slow
async def test_sft_lowers_the_loss_on_its_data(tf_backend):
    backend, _ = tf_backend
    model = art.TrainableModel(name="sft-learns", project="art-api", base_model="smollm2",
                               config=art.ModelConfig(engine=art.EngineConfig(max_model_len=256)))
    await model.register(backend)
    data = [art.Trajectory(messages_and_choices=[
        {"role": "user", "content": f"Code word {i}?"},
        {"role": "assistant", "content": "Zanzibar-7 pelican"}]) for i in range(4)]
    for _ in range(4):
        await model.train_sft(data, config=art.TrainSFTConfig(learning_rate=1e-3, batch_size=4))
    losses = [h["loss"] for h in await model.history() if h.get("sft_batches")]
    assert losses[-1] < 0.5 * losses[0]
