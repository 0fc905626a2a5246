"""Porting ART scripts: tracerl.utils, tracerl.rewards and tracerl.local take ART's arguments.

The judge is the stand-in server that tests/test_ruler.py uses; LiteLLM, the dataset iteration,
the gateway, the engine and the trainer are real."""

import asyncio
import json
import logging
import subprocess
from types import SimpleNamespace

import pytest
from openai.types.chat.chat_completion import Choice

import tracerl
from tests.judge_server import JudgeServer, good
from tracerl.core.art_compat import train_options_from_art
from tracerl.core.trajectory import read_groups_jsonl
from tracerl.rewards import DEFAULT_RUBRIC, ruler, ruler_score_group
from tracerl.utils import DatasetBatch, iterate_dataset, limit_concurrency

SCENARIOS = [f"scenario-{i}" for i in range(7)]


def all_batches(**kwargs):
    return list(iterate_dataset(SCENARIOS, use_tqdm=False, **kwargs))


def items_of_epoch(batches, epoch):
    return [item for b in batches if b.epoch == epoch for item in b.items]


# --- iterate_dataset -------------------------------------------------------------------------


def test_batches_are_numbered_by_step_epoch_and_step_in_epoch():
    batches = all_batches(groups_per_step=3, num_epochs=2)
    assert [(b.step, b.epoch, b.epoch_step, len(b.items)) for b in batches] == [
        (0, 0, 0, 3), (1, 0, 1, 3), (2, 0, 2, 1), (3, 1, 0, 3), (4, 1, 1, 3), (5, 1, 2, 1)]


@pytest.mark.parametrize("epoch", [0, 1])
def test_every_item_is_served_once_per_epoch(epoch):
    served = items_of_epoch(all_batches(groups_per_step=3, num_epochs=2), epoch)
    assert sorted(served) == sorted(SCENARIOS)


@pytest.mark.parametrize("epoch", [0, 1])
def test_each_epoch_is_shuffled(epoch):
    assert items_of_epoch(all_batches(groups_per_step=3, num_epochs=2), epoch) != SCENARIOS


def test_epochs_are_shuffled_differently():
    batches = all_batches(groups_per_step=3, num_epochs=2)
    assert items_of_epoch(batches, 0) != items_of_epoch(batches, 1)


def test_the_same_seed_gives_the_same_batches():
    assert all_batches(groups_per_step=3, num_epochs=2) == all_batches(groups_per_step=3,
                                                                       num_epochs=2)


def test_another_seed_gives_other_batches():
    assert all_batches(groups_per_step=3, num_epochs=2, seed=1) != all_batches(
        groups_per_step=3, num_epochs=2)


def test_shuffle_false_keeps_the_order():
    assert all_batches(groups_per_step=7, shuffle=False) == [
        DatasetBatch(items=SCENARIOS, step=0, epoch=0, epoch_step=0)]


FULL_RUN = all_batches(groups_per_step=2, num_epochs=3)


@pytest.mark.parametrize("step", range(len(FULL_RUN) + 2))
def test_resuming_at_a_step_gives_the_batches_an_uninterrupted_run_would(step):
    assert all_batches(groups_per_step=2, num_epochs=3, initial_step=step) == FULL_RUN[step:]


BAD_DATASET_ARGUMENTS = {
    "zero-groups-per-step": ({"groups_per_step": 0}, "groups_per_step"),
    "fractional-epochs": ({"num_epochs": 1.5}, "num_epochs"),
    "negative-initial-step": ({"initial_step": -1}, "initial_step"),
    "bool-groups-per-step": ({"groups_per_step": True}, "groups_per_step"),
}


@pytest.mark.parametrize("case", BAD_DATASET_ARGUMENTS, ids=list(BAD_DATASET_ARGUMENTS))
def test_a_bad_argument_is_named_at_the_call(case):
    kwargs, needle = BAD_DATASET_ARGUMENTS[case]
    with pytest.raises(ValueError, match=needle):
        iterate_dataset(SCENARIOS, **kwargs)  # raised at the call, not at the first next()


def test_an_empty_dataset_is_refused():
    with pytest.raises(ValueError, match="empty"):
        iterate_dataset([])


def test_a_generator_is_accepted_as_the_dataset():
    generated = list(
        iterate_dataset((s for s in SCENARIOS), groups_per_step=4, num_epochs=2, use_tqdm=False)
    )
    assert [b.step for b in generated] == [0, 1, 2, 3]
    assert sorted(i for b in generated for i in b.items) == sorted(SCENARIOS * 2)


# --- limit_concurrency -----------------------------------------------------------------------


def limited_burst():
    """A limited function called 10 times for each of two keys, all at once; returns a function
    that runs the burst in a new event loop and gives (results, peak concurrency per key)."""
    running: dict[str, int] = {}
    peak: dict[str, int] = {}

    @limit_concurrency(2, derive_key=lambda tenant, i: tenant)
    async def call(tenant: str, i: int) -> int:
        running[tenant] = running.get(tenant, 0) + 1
        peak[tenant] = max(peak.get(tenant, 0), running[tenant])
        await asyncio.sleep(0)  # yield while holding the slot: uncapped calls would pile up here
        running[tenant] -= 1
        return i

    async def burst():
        return await asyncio.gather(*[call(t, i) for i in range(10) for t in ("a", "b")])

    def run():
        peak.clear()
        return sorted(asyncio.run(burst())), dict(peak)

    return run


def test_limit_concurrency_caps_calls_per_key():
    _, peak = limited_burst()()
    assert peak == {"a": 2, "b": 2}


def test_limit_concurrency_works_in_each_new_event_loop():
    run = limited_burst()
    first, second = run(), run()  # a semaphore made in the first loop would fail in the second
    assert first == second == (sorted(list(range(10)) * 2), {"a": 2, "b": 2})


BAD_LIMITS = {
    "zero": (lambda: limit_concurrency(0), ValueError, "n must be an integer >= 1"),
    "sync-function": (lambda: limit_concurrency(1)(lambda: None), TypeError, "async functions"),
}


@pytest.mark.parametrize("case", BAD_LIMITS, ids=list(BAD_LIMITS))
def test_limit_concurrency_refuses_bad_use(case):
    make, error, needle = BAD_LIMITS[case]
    with pytest.raises(error, match=needle):
        make()


# --- RULER with ART's arguments --------------------------------------------------------------


def judge_for_art():
    return JudgeServer([good(lambda tid, k: round(0.2 + 0.3 * k, 2))])


@pytest.fixture
def judge_server():
    server = judge_for_art()
    yield server
    server.close()


def group(*answers):
    task = {"role": "user", "content": "Name a prime number."}
    return tracerl.TrajectoryGroup(
        [
            tracerl.Trajectory(
                messages_and_choices=[task, {"role": "assistant", "content": a}], reward=i / 10
            )
            for i, a in enumerate(answers)
        ]
    )


@pytest.fixture(scope="module")
async def art_ruler_call():
    """One ``ruler_score_group`` call with ART's positional arguments, through real LiteLLM."""
    server = judge_for_art()
    try:
        scored = await ruler_score_group(
            group("7", "9", "11"),
            "openai/judge",
            {"api_base": server.url, "api_key": "judge-key"},
            DEFAULT_RUBRIC,
            swallow_exceptions=False,
        )
    finally:
        server.close()
    (request,) = server.requests
    return SimpleNamespace(scored=scored, request=request)


async def test_litellm_routes_the_judge_model_to_the_api_base(art_ruler_call):
    assert art_ruler_call.request["model"] == "judge"  # "openai/judge" reached our api_base


async def test_the_judge_is_asked_for_structured_output(art_ruler_call):
    assert art_ruler_call.request["response_format"]["type"] == "json_schema"


async def test_each_trajectory_gets_the_judges_score_for_it(art_ruler_call):
    assert [t.reward for t in art_ruler_call.scored] == [0.2, 0.5, 0.8]


async def test_the_reward_before_judging_is_kept_as_independent_reward(art_ruler_call):
    assert [t.metrics["independent_reward"] for t in art_ruler_call.scored] == [0.0, 0.1, 0.2]


async def test_the_judges_explanation_is_logged_on_the_trajectory(art_ruler_call):
    assert [t.logs for t in art_ruler_call.scored] == [["RULER explanation: ok"]] * 3


async def test_debug_logs_each_judge_answer(judge_server, caplog):
    caplog.set_level(logging.DEBUG)
    await ruler_score_group(group("7", "9"), "openai/judge",
                            {"api_base": judge_server.url, "api_key": "k"}, debug=True)
    assert "[ruler] openai/judge answered (attempt 1)" in caplog.text


async def test_an_unreachable_judge_with_swallow_exceptions_gives_none():
    unreachable = {"api_base": "http://127.0.0.1:9/v1", "api_key": "k"}
    assert await ruler_score_group(
        group("2", "4"), "openai/judge", unreachable, swallow_exceptions=True, max_retries=0
    ) is None


@pytest.fixture
async def raw_list_scores(judge_server):
    task = {"role": "user", "content": "Name a prime number."}
    lists = [[task, {"role": "assistant", "content": a}] for a in ("4", "13", "4")]
    scores = await ruler(lists, "openai/judge", {"api_base": judge_server.url, "api_key": "k"})
    prompt = judge_server.requests[0]["messages"][-1]["content"]
    return SimpleNamespace(scores=scores, prompt=prompt)


async def test_ruler_on_raw_message_lists_numbers_them_in_order(raw_list_scores):
    assert [s.trajectory_id for s in raw_list_scores.scores] == ["1", "2", "3"]


async def test_ruler_gives_identical_lists_identical_scores(raw_list_scores):
    first, second, third = (s.score for s in raw_list_scores.scores)
    assert first == third != second


async def test_ruler_sends_a_duplicate_list_once(raw_list_scores):
    assert raw_list_scores.prompt.count("<trajectory id=") == 2


async def test_ruler_of_no_lists_is_empty_without_asking():
    assert await ruler([], "openai/judge") == []


async def test_extra_litellm_params_beside_a_client_are_refused():
    with pytest.raises(ValueError, match="extra_litellm_params"):
        await ruler_score_group(group("a", "b"), "judge", {"api_base": "x"}, client=object())


def trajectory_with_summary(summary):
    return tracerl.Trajectory(
        messages_and_choices=[
            {"role": "user", "content": "Plan a trip."},
            {"role": "assistant", "content": "Rome."},
        ],
        additional_histories=[
            tracerl.History(
                messages_and_choices=[
                    {"role": "user", "content": "Summarise the plan."},
                    {"role": "assistant", "content": summary},
                ]
            )
        ],
    )


async def test_ruler_tells_trajectories_apart_by_their_additional_histories(judge_server):
    g = tracerl.TrajectoryGroup([trajectory_with_summary("Rome, 3 days."),
                                 trajectory_with_summary("No idea.")])
    scored = await ruler_score_group(
        g, "openai/judge", {"api_base": judge_server.url, "api_key": "k"})
    # the main conversations are identical: only the sub-agent's answers differ
    assert [t.reward for t in scored] == [0.2, 0.5]


async def test_ruler_shows_the_judge_the_additional_histories(judge_server):
    g = tracerl.TrajectoryGroup([trajectory_with_summary("Rome, 3 days."),
                                 trajectory_with_summary("No idea.")])
    await ruler_score_group(g, "openai/judge", {"api_base": judge_server.url, "api_key": "k"})
    prompt = judge_server.requests[0]["messages"][-1]["content"]
    assert "additional history 1" in prompt
    assert "No idea." in prompt and "Rome, 3 days." in prompt


# --- an ART training loop --------------------------------------------------------------------


def test_tracerl_local_is_arts_import_path_of_the_local_backend():
    from tracerl.local import LocalBackend

    assert LocalBackend is tracerl.LocalBackend


@pytest.fixture(scope="module")
async def ported_loop(tf_backend):
    """ART's training loop with only the imports changed: iterate_dataset, gather with RULER
    as after_each, train; then a restarted script resumes from the model's step."""
    backend, _ = tf_backend
    model = tracerl.TrainableModel(name="ported", project="tests", base_model="smollm2")
    await model.register(backend)
    server = judge_for_art()
    judge_params = {"api_base": server.url, "api_key": "k"}

    async def rollout(model: tracerl.TrainableModel, scenario: str) -> tracerl.Trajectory:
        messages = [{"role": "user", "content": f"Say {scenario}."}]
        response = await model.openai_client().chat.completions.create(
            model=model.get_inference_name(), messages=messages, max_tokens=4, temperature=1.0)
        return tracerl.Trajectory(messages_and_choices=[*messages, response.choices[0]],
                                  reward=0.0, metadata={"scenario": scenario})

    scenarios = SCENARIOS[:3]
    trained = []
    try:
        for batch in iterate_dataset(scenarios, groups_per_step=2, num_epochs=1,
                                     initial_step=await model.get_step(), use_tqdm=False):
            groups = await tracerl.gather_trajectory_groups(
                (tracerl.TrajectoryGroup(rollout(model, s) for _ in range(2))
                 for s in batch.items),
                after_each=lambda g: ruler_score_group(
                    g, "openai/judge", judge_params, swallow_exceptions=True
                ),
                pbar_desc="gather",
                max_exceptions=0,
                show_progress=False,
            )
            await model.train(groups, config=tracerl.TrainConfig(learning_rate=1e-4))
            trained.append(batch.step)
    finally:
        server.close()
    step = await model.get_step()
    saved = read_groups_jsonl(backend.store(model).trajectories_path("train", 1))

    again = tracerl.TrainableModel(name="ported", project="tests", base_model="smollm2")
    await again.register(backend)
    resumed = [b.step for b in iterate_dataset(scenarios, groups_per_step=2, num_epochs=2,
                                               initial_step=await again.get_step(),
                                               use_tqdm=False)]
    return SimpleNamespace(trained=trained, step=step, saved=saved, resumed=resumed)


async def test_the_ported_loop_trains_one_step_per_batch(ported_loop):
    assert (ported_loop.trained, ported_loop.step) == ([0, 1], 2)


async def test_the_ported_loop_trains_on_rulers_scores(ported_loop):
    trajectories = [t for g in ported_loop.saved for t in g]
    assert len(trajectories) == 4  # the first batch: two scenarios, two rollouts each
    assert [t.reward for t in trajectories] == [t.metrics["ruler_score"] for t in trajectories]


async def test_a_restarted_script_resumes_where_training_stopped(ported_loop):
    assert ported_loop.resumed == [2, 3]  # one more epoch gives only the new steps


def answer(text):
    return Choice.model_validate({"index": 0, "finish_reason": "stop",
                                  "message": {"role": "assistant", "content": text}})


def trajectory_with_history(reward, text):
    return tracerl.Trajectory(
        messages_and_choices=[{"role": "user", "content": "Plan a trip."}, answer(text)],
        additional_histories=[tracerl.History(messages_and_choices=[
            {"role": "user", "content": "Summarise the plan."}, answer(f"Summary: {text}")])],
        reward=reward)


@pytest.fixture(scope="module")
async def histories_model(tf_backend):
    backend, _ = tf_backend
    model = tracerl.TrainableModel(name="histories", project="tests", base_model="smollm2")
    await model.register(backend)
    group = tracerl.TrajectoryGroup([trajectory_with_history(1.0, "Go to Rome."),
                                     trajectory_with_history(0.0, "Stay home.")])
    metrics = await model.train([group], config=tracerl.TrainConfig(learning_rate=1e-4))
    return SimpleNamespace(model=model, group=group, metrics=metrics)


async def test_additional_histories_train_when_there_are_no_token_records(histories_model):
    metrics = histories_model.metrics
    assert (metrics["rendered_rows"], metrics["rows"]) == (4, 4)  # 2 trajectories x 2 histories


async def test_an_art_config_option_without_an_equivalent_is_refused_before_training(
        histories_model):
    model = histories_model.model
    step = await model.get_step()
    with pytest.raises(tracerl.ConfigError, match="normalize_by_length"):
        await model.train([histories_model.group], _config={"normalize_by_length": False})
    assert await model.get_step() == step


# --- ART's configs ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def converted_internal_config():
    internal = tracerl.dev.InternalModelConfig(
        init_args=tracerl.dev.InitArgs(max_seq_length=4096),
        engine_args=tracerl.dev.EngineArgs(
            enforce_eager=True,
            gpu_memory_utilization=0.7,
            max_num_seqs=64,
            enable_prefix_caching=False,
            tool_call_parser="hermes",
            enable_auto_tool_choice=True,
        ),
        peft_args={"r": 16, "lora_alpha": 32, "target_modules": ["q_proj", "v_proj"]},
    )
    return tracerl.TrainableModel(
        name="m", project="p", base_model="smollm2", _internal_config=internal
    ).config


def test_arts_engine_args_become_engine_settings(converted_internal_config):
    engine = converted_internal_config.engine
    assert (engine.max_model_len, engine.gpu_memory_utilization, engine.max_num_seqs,
            engine.tool_call_parser) == (4096, 0.7, 64, "hermes")


def test_arts_engine_switches_become_vllm_flags(converted_internal_config):
    assert converted_internal_config.engine.extra_args == [
        "--enforce-eager", "--no-enable-prefix-caching"]


def test_arts_peft_args_become_the_lora_config(converted_internal_config):
    lora = converted_internal_config.lora
    assert (lora.r, lora.alpha, lora.target_modules) == (16, 32, ["q_proj", "v_proj"])


@pytest.mark.vllm
def test_engine_args_become_flags_that_vllm_parses():
    from tracerl.backend.engines.vllm_engine import VLLMEngine, vllm_python

    if not VLLMEngine.available():
        pytest.skip("needs vLLM (TRACERL_VLLM_PYTHON)")
    flags = tracerl.TrainableModel(
        name="m",
        project="p",
        base_model="smollm2",
        _internal_config={
            "engine_args": {
                "enforce_eager": False,
                "enable_prefix_caching": False,
                "max_num_batched_tokens": 4096,
            }
        },
    ).config.engine.extra_args
    parse = (
        "import sys, json\n"
        "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
        "from vllm.engine.arg_utils import AsyncEngineArgs\n"
        "a = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(sys.argv[1:])\n"
        "print(json.dumps([a.enforce_eager, a.enable_prefix_caching, a.max_num_batched_tokens]))"
    )
    out = subprocess.run(
        [str(vllm_python()), "-c", parse, "--model", "x", *flags],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    assert json.loads(out.strip().splitlines()[-1]) == [False, False, 4096]


UNMAPPED_INTERNAL_CONFIGS = {
    "4-bit-loading": ({"init_args": {"load_in_4bit": True}}, "load_in_4bit"),
    "trainer-args": ({"trainer_args": {"learning_rate": 1e-5}}, "trainer_args"),
    "rslora": ({"lora_config": {"rank": 8, "use_rslora": True}}, "use_rslora"),
    "memory-over-1": ({"engine_args": {"gpu_memory_utilization": 2.0}},
                      "gpu_memory_utilization"),
    "engine-args-not-a-dict": ({"engine_args": "enforce_eager"}, "must be a dict"),
}


@pytest.mark.parametrize("case", UNMAPPED_INTERNAL_CONFIGS, ids=list(UNMAPPED_INTERNAL_CONFIGS))
def test_internal_config_keys_without_an_equivalent_are_named(case):
    internal, needle = UNMAPPED_INTERNAL_CONFIGS[case]
    with pytest.raises(tracerl.ConfigError, match=needle):
        tracerl.TrainableModel(
            name="m", project="p", base_model="smollm2", _internal_config=internal
        )


def test_config_and_internal_config_together_are_refused():
    with pytest.raises(tracerl.ConfigError, match="not both"):
        tracerl.TrainableModel(
            name="m",
            project="p",
            base_model="smollm2",
            config=tracerl.ModelConfig(),
            _internal_config={},
        )


def test_arts_per_step_config_maps_to_train_config_fields():
    assert train_options_from_art(tracerl.dev.TrainConfig(
        epsilon=0.3, epsilon_high=0.4, scale_rewards=False, kl_penalty_coef=0.05,
        allow_training_without_logprobs=True)) == {
        "epsilon": 0.3, "epsilon_high": 0.4, "scale_rewards": False, "beta": 0.05}


def test_an_art_per_step_option_without_an_equivalent_is_named():
    with pytest.raises(tracerl.ConfigError, match="importance_sampling_level"):
        train_options_from_art({"importance_sampling_level": "sequence"})


def test_train_config_takes_arts_kl_coefficient_name():
    assert tracerl.TrainConfig(learning_rate=1e-5, kl_penalty_coef=0.05).beta == 0.05


def test_train_config_takes_arts_current_learner_kl_source():
    config = tracerl.TrainConfig(kl_penalty_source="current_learner", kl_penalty_coef=0.05)
    assert config.beta == 0.05


def test_train_config_refuses_kl_at_the_sampled_logprobs():
    with pytest.raises(ValueError, match="kl_penalty_source"):
        tracerl.TrainConfig(kl_penalty_source="sample")  # not offered


async def test_local_backend_takes_arts_arguments(tmp_path, monkeypatch):
    from tracerl.local import LocalBackend

    monkeypatch.chdir(tmp_path)
    async with LocalBackend(path=None, in_process=True) as backend:
        assert backend.path.resolve() == (tmp_path / ".tracerl").resolve()


# --- LiteLLM completion params ---------------------------------------------------------------


@pytest.fixture(scope="module")
async def litellm_call(tf_backend):
    import litellm

    _, model = tf_backend
    with tracerl.rollout_scope() as rollout:
        params = model.litellm_completion_params()
        response = await litellm.acompletion(
            messages=[{"role": "user", "content": "Say hi."}], max_tokens=3, **params)
    (call,) = await model.fetch_calls(rollout.rollout_id)
    return SimpleNamespace(model=model, params=params, response=response, call=call)


async def test_litellm_params_name_the_model_as_hosted_vllm_at_temperature_1(litellm_call):
    params = litellm_call.params
    assert (params["model"], params["temperature"]) == (
        f"hosted_vllm/{litellm_call.model.project}/{litellm_call.model.name}", 1)


async def test_a_litellm_call_is_recorded_under_its_rollout(litellm_call):
    call = litellm_call.call
    assert call.completions[0].text == litellm_call.response.choices[0].message.content
    assert call.prompt_token_ids and call.temperature == 1.0


async def test_litellm_params_can_pin_a_step(litellm_call):
    model = litellm_call.model
    assert model.litellm_completion_params(step=0)["model"] == (
        f"hosted_vllm/{model.project}/{model.name}@0")  # qualified: see test_model_names.py


def test_an_external_models_litellm_params_keep_its_name():
    external = tracerl.Model(
        name="baseline",
        project="tests",
        inference_model_name="openai/gpt-4o-mini",
        inference_base_url="https://api.openai.com/v1",
        inference_api_key="k",
    )
    assert external.litellm_completion_params()["model"] == "openai/gpt-4o-mini"
