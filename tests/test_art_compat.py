"""Porting ART scripts: tracerl.utils, tracerl.rewards and tracerl.local take ART's arguments.

The judge is the stand-in server that tests/test_ruler.py uses; LiteLLM, the dataset iteration,
the gateway, the engine and the trainer are real."""

import asyncio
import json

import pytest

import tracerl
from tests.judge_server import JudgeServer, good
from tracerl.core.art_compat import train_options_from_art
from tracerl.rewards import DEFAULT_RUBRIC, ruler, ruler_score_group
from tracerl.utils import DatasetBatch, iterate_dataset, limit_concurrency

SCENARIOS = [f"scenario-{i}" for i in range(7)]


def all_batches(**kwargs):
    return list(iterate_dataset(SCENARIOS, use_tqdm=False, **kwargs))


def test_every_item_once_per_epoch_in_numbered_steps():
    batches = all_batches(groups_per_step=3, num_epochs=2)
    assert [(b.step, b.epoch, b.epoch_step, len(b.items)) for b in batches] == [
        (0, 0, 0, 3), (1, 0, 1, 3), (2, 0, 2, 1), (3, 1, 0, 3), (4, 1, 1, 3), (5, 1, 2, 1)]
    for epoch in (0, 1):
        served = [item for b in batches if b.epoch == epoch for item in b.items]
        assert sorted(served) == sorted(SCENARIOS)
    first, second = ([i for b in batches if b.epoch == e for i in b.items] for e in (0, 1))
    assert first != second != SCENARIOS  # shuffled, differently per epoch
    assert all_batches(groups_per_step=3, num_epochs=2) == batches  # deterministic
    assert all_batches(groups_per_step=3, num_epochs=2, seed=1) != batches
    unshuffled = all_batches(groups_per_step=7, shuffle=False)
    assert unshuffled == [DatasetBatch(items=SCENARIOS, step=0, epoch=0, epoch_step=0)]


def test_resuming_at_any_step_gives_the_batches_an_uninterrupted_run_would():
    full = all_batches(groups_per_step=2, num_epochs=3)
    for step in range(len(full) + 2):
        assert all_batches(groups_per_step=2, num_epochs=3, initial_step=step) == full[step:]


def test_bad_arguments_are_named_and_iterables_are_accepted():
    for kwargs, needle in [
        ({"groups_per_step": 0}, "groups_per_step"),
        ({"num_epochs": 1.5}, "num_epochs"),
        ({"initial_step": -1}, "initial_step"),
        ({"groups_per_step": True}, "groups_per_step"),
    ]:
        with pytest.raises(ValueError, match=needle):
            iterate_dataset(SCENARIOS, **kwargs)  # raised at the call, not at the first next()
    with pytest.raises(ValueError, match="empty"):
        iterate_dataset([])
    generated = list(
        iterate_dataset((s for s in SCENARIOS), groups_per_step=4, num_epochs=2, use_tqdm=False)
    )
    assert [b.step for b in generated] == [0, 1, 2, 3] and sum(
        len(b.items) for b in generated
    ) == 14


def test_limit_concurrency_caps_calls_per_key_across_event_loops():
    running: dict[str, int] = {}
    peak: dict[str, int] = {}

    @limit_concurrency(2, derive_key=lambda tenant, i: tenant)
    async def call(tenant: str, i: int) -> int:
        running[tenant] = running.get(tenant, 0) + 1
        peak[tenant] = max(peak.get(tenant, 0), running[tenant])
        await asyncio.sleep(0.01)
        running[tenant] -= 1
        return i

    async def burst():
        return await asyncio.gather(*[call(t, i) for i in range(10) for t in ("a", "b")])

    for _ in range(2):  # a second event loop: a module-level semaphore would fail here
        assert sorted(asyncio.run(burst())) == sorted(list(range(10)) * 2)
    assert peak == {"a": 2, "b": 2}
    with pytest.raises(ValueError, match="n must be an integer >= 1"):
        limit_concurrency(0)
    with pytest.raises(TypeError, match="async functions"):
        limit_concurrency(1)(lambda: None)


@pytest.fixture
def judge_server():
    server = JudgeServer([good(lambda tid, k: round(0.2 + 0.3 * k, 2))])
    yield server
    server.close()


def group(*answers):
    task = {"role": "user", "content": "Name a prime number."}
    return tracerl.TrajectoryGroup(
        [
            tracerl.Trajectory(
                messages_and_choices=[task, {"role": "assistant", "content": a}], reward=0.0
            )
            for a in answers
        ]
    )


async def test_ruler_score_group_takes_arts_arguments_through_real_litellm(judge_server, caplog):
    litellm_params = {"api_base": judge_server.url, "api_key": "judge-key"}
    scored = await ruler_score_group(
        group("7", "9", "11"),
        "openai/judge",
        litellm_params,
        DEFAULT_RUBRIC,
        swallow_exceptions=False,
        debug=True,
    )
    (request,) = judge_server.requests
    assert request["model"] == "judge"  # LiteLLM routed "openai/judge" to our api_base
    assert request["response_format"]["type"] == "json_schema"
    assert sorted(t.reward for t in scored) == [0.2, 0.5, 0.8]
    assert all(t.metrics["independent_reward"] == 0.0 for t in scored)
    assert all(t.logs == ["RULER explanation: ok"] for t in scored)
    assert "[ruler] openai/judge answered (attempt 1)" in caplog.text

    unreachable = {"api_base": "http://127.0.0.1:9/v1", "api_key": "k"}
    assert (
        await ruler_score_group(
            group("2", "4"), "openai/judge", unreachable, swallow_exceptions=True, max_retries=0
        )
        is None
    )


async def test_ruler_scores_raw_message_lists_in_order(judge_server):
    task = {"role": "user", "content": "Name a prime number."}
    lists = [[task, {"role": "assistant", "content": a}] for a in ("4", "13", "4")]
    scores = await ruler(lists, "openai/judge", {"api_base": judge_server.url, "api_key": "k"})
    assert [s.trajectory_id for s in scores] == ["1", "2", "3"]
    # identical lists, identical scores
    assert scores[0].score == scores[2].score != scores[1].score
    prompt = judge_server.requests[0]["messages"][-1]["content"]
    assert prompt.count("<trajectory id=") == 2  # the duplicate is sent once
    assert await ruler([], "openai/judge") == []


async def test_extra_litellm_params_beside_a_client_are_refused():
    with pytest.raises(ValueError, match="extra_litellm_params"):
        await ruler_score_group(group("a", "b"), "judge", {"api_base": "x"}, client=object())


async def test_an_art_training_loop_ports_by_changing_the_imports(tf_backend, judge_server):
    from tracerl.local import LocalBackend

    backend, _ = tf_backend
    assert isinstance(backend, LocalBackend)
    model = tracerl.TrainableModel(name="ported", project="tests", base_model="smollm2")
    await model.register(backend)
    judge_params = {"api_base": judge_server.url, "api_key": "k"}

    async def rollout(model: tracerl.TrainableModel, scenario: str) -> tracerl.Trajectory:
        messages = [{"role": "user", "content": f"Say {scenario}."}]
        response = await model.openai_client().chat.completions.create(
            model=model.get_inference_name(), messages=messages, max_tokens=4, temperature=1.0)
        return tracerl.Trajectory(messages_and_choices=[*messages, response.choices[0]], reward=0.0,
                                  metadata={"scenario": scenario})

    scenarios = SCENARIOS[:3]
    trained = []
    for batch in iterate_dataset(scenarios, groups_per_step=2, num_epochs=1,
                                 initial_step=await model.get_step(), use_tqdm=False):
        groups = await tracerl.gather_trajectory_groups(
            (tracerl.TrajectoryGroup(rollout(model, s) for _ in range(2)) for s in batch.items),
            after_each=lambda g: ruler_score_group(
                g, "openai/judge", judge_params, swallow_exceptions=True
            ),
            pbar_desc="gather",
            max_exceptions=0,
            show_progress=False,
        )
        await model.train(groups, config=tracerl.TrainConfig(learning_rate=1e-4))
        trained.append(batch.step)
    assert trained == [0, 1] and await model.get_step() == 2
    saved = backend.store(model).trajectories_path("train", 1).read_text().splitlines()
    assert any("ruler_score" in json.dumps(json.loads(line)) for line in saved)

    # a restarted script resumes where training stopped: one more epoch gives only new steps
    again = tracerl.TrainableModel(name="ported", project="tests", base_model="smollm2")
    await again.register(backend)
    resumed = [b.step for b in iterate_dataset(scenarios, groups_per_step=2, num_epochs=2,
                                               initial_step=await again.get_step(), use_tqdm=False)]
    assert resumed == [2, 3]


async def test_additional_histories_train_when_there_are_no_token_records(tf_backend):
    from openai.types.chat.chat_completion import Choice

    backend, _ = tf_backend
    model = tracerl.TrainableModel(name="histories", project="tests", base_model="smollm2")
    await model.register(backend)

    def answer(text):
        return Choice.model_validate({"index": 0, "finish_reason": "stop",
                                      "message": {"role": "assistant", "content": text}})

    def trajectory(reward, text):
        return tracerl.Trajectory(
            messages_and_choices=[{"role": "user", "content": "Plan a trip."}, answer(text)],
            additional_histories=[tracerl.History(messages_and_choices=[
                {"role": "user", "content": "Summarise the plan."}, answer(f"Summary: {text}")])],
            reward=reward)

    group = tracerl.TrajectoryGroup([trajectory(1.0, "Go to Rome."), trajectory(0.0, "Stay home.")])
    metrics = await model.train([group], config=tracerl.TrainConfig(learning_rate=1e-4))
    assert metrics["rendered_rows"] == 4 and metrics["rows"] == 4  # 2 trajectories x 2 histories
    with pytest.raises(tracerl.ConfigError, match="normalize_by_length"):
        await model.train([group], _config={"normalize_by_length": False})
    assert await model.get_step() == 1  # refused before anything ran


def test_arts_internal_config_becomes_a_model_config():
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
    model = tracerl.TrainableModel(
        name="m", project="p", base_model="smollm2", _internal_config=internal
    )
    engine, lora = model.config.engine, model.config.lora
    assert (engine.max_model_len, engine.gpu_memory_utilization, engine.max_num_seqs) == (
        4096,
        0.7,
        64,
    )
    assert engine.tool_call_parser == "hermes"
    assert engine.extra_args == ["--enforce-eager", "--no-enable-prefix-caching"]
    assert (lora.r, lora.alpha, lora.target_modules) == (16, 32, ["q_proj", "v_proj"])


@pytest.mark.vllm
def test_engine_args_become_flags_that_vllm_parses():
    import subprocess

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


@pytest.mark.parametrize("internal, needle", [
    ({"init_args": {"load_in_4bit": True}}, "load_in_4bit"),
    ({"trainer_args": {"learning_rate": 1e-5}}, "trainer_args"),
    ({"lora_config": {"rank": 8, "use_rslora": True}}, "use_rslora"),
    ({"engine_args": {"gpu_memory_utilization": 2.0}}, "gpu_memory_utilization"),
    ({"engine_args": "enforce_eager"}, "must be a dict"),
])
def test_internal_config_keys_without_an_equivalent_are_named(internal, needle):
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
    with pytest.raises(tracerl.ConfigError, match="importance_sampling_level"):
        train_options_from_art({"importance_sampling_level": "sequence"})


async def test_local_backend_takes_arts_arguments(tmp_path, monkeypatch):
    from tracerl.local import LocalBackend

    monkeypatch.chdir(tmp_path)
    async with LocalBackend(path=None, in_process=True) as backend:
        assert backend.path.resolve() == (tmp_path / ".tracerl").resolve()


async def test_litellm_completion_params_reach_the_gateway_and_attribute_the_call(tf_backend):
    import litellm

    _, model = tf_backend
    messages = [{"role": "user", "content": "Say hi."}]
    with tracerl.rollout_scope() as rollout:
        params = model.litellm_completion_params()
        response = await litellm.acompletion(messages=messages, max_tokens=3, **params)
    assert params["model"] == f"hosted_vllm/{model.name}" and params["temperature"] == 1
    (call,) = await model.fetch_calls(rollout.rollout_id)
    assert call.completions[0].text == response.choices[0].message.content
    assert call.prompt_token_ids and call.temperature == 1.0
    assert model.litellm_completion_params(step=0)["model"] == f"hosted_vllm/{model.name}@0"
    external = tracerl.Model(
        name="baseline",
        project="tests",
        inference_model_name="openai/gpt-4o-mini",
        inference_base_url="https://api.openai.com/v1",
        inference_api_key="k",
    )
    assert external.litellm_completion_params()["model"] == "openai/gpt-4o-mini"


def test_train_config_takes_arts_kl_names():
    assert tracerl.TrainConfig(learning_rate=1e-5, kl_penalty_coef=0.05).beta == 0.05
    assert tracerl.TrainConfig(kl_penalty_source="current_learner").beta == 0.0
    with pytest.raises(ValueError, match="kl_penalty_source"):
        tracerl.TrainConfig(kl_penalty_source="sample")  # KL at the sampled logprobs: not offered


async def test_ruler_reads_additional_histories(judge_server):
    def trajectory(summary):
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

    group = tracerl.TrajectoryGroup([trajectory("Rome, 3 days."), trajectory("No idea.")])
    scored = await ruler_score_group(
        group, "openai/judge", {"api_base": judge_server.url, "api_key": "k"}
    )
    assert sorted(t.reward for t in scored) == [0.2, 0.5]  # the sub-agent's answer told them apart
    prompt = judge_server.requests[0]["messages"][-1]["content"]
    assert "additional history 1" in prompt and "No idea." in prompt and "Rome, 3 days." in prompt
