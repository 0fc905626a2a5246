"""OpenPipe ART 0.5.23's new top-level names, used as ART's own code and examples use them, with
``import tracerl as art``: ``get_tokenizer`` and ``tokenize``/``tensorize`` on trajectories the
gateway recorded (real SmolLM2 on the transformers engine), the pipeline configs on a real
``PipelineTrainer`` step, the metric definitions, ``LocalServingUnavailableError`` from a real
engine, ``art.mcp`` (scenario generation against a real HTTP endpoint), and every other name of
ART 0.5.23's ``__all__`` either importable or refusing with the alternative named."""

from __future__ import annotations

import json
import math

import pytest
import torch
from openai.types.chat.chat_completion import Choice

import tracerl as art
from tracerl.mcp import (
    GeneratedScenarioCollection,
    MCPResource,
    MCPTool,
    complete_task_tool,
    generate_scenarios,
)
from tracerl.trajectories import TokenFlag

from .conftest import render_ids
from .judge_server import JudgeServer

# OpenPipe ART 0.5.23's top-level API: `__all__` of src/art/__init__.py in the PyPI wheel
# openpipe_art-0.5.23-py3-none-any.whl (pip download openpipe-art==0.5.23), copied verbatim.
ART_0523_ALL = [
    "dev", "current_trajectory", "no_capture", "gather_trajectories", "gather_trajectory_groups",
    "trajectory_group_batches", "Backend", "LocalTrainResult", "LoRAConfig",
    "LocalServingUnavailableError", "MegatronRuntimeConfig", "MegatronTopologyConfig",
    "MetricDefinition", "PipelineAutotuneConfig", "PipelineRuntimeConfig",
    "PIPELINE_RL_DASHBOARD_DEFAULT_METRICS", "PIPELINE_RL_METRIC_DEFINITIONS",
    "PIPELINE_RL_SCORE_METRICS", "get_megatron_runtime_config", "get_tokenizer",
    "init_megatron_runtime_config", "ServerlessBackend", "ServerlessTrainResult", "Messages",
    "MessagesAndChoices", "Tools", "Model", "TrainableModel", "retry", "TrainSFTConfig",
    "TrainConfig", "TrainResult", "Trajectory", "TrajectoryGroup", "tokenize", "tensorize",
    "trajectory", "trajectory_group", "capture_yielded_trajectory", "yield_trajectory",
]
# the names tracerl does not port: using one raises a ConfigError naming the alternative
UNPORTED = {
    "MegatronRuntimeConfig": "DistributedTrainerConfig",
    "MegatronTopologyConfig": "DistributedTrainerConfig",
    "get_megatron_runtime_config": "DistributedTrainerConfig",
    "init_megatron_runtime_config": "DistributedTrainerConfig",
    "ServerlessBackend": "RemoteBackend",
    "ServerlessTrainResult": "LocalBackend",
}
SAMPLED = TokenFlag.EXACT | TokenFlag.SAMPLED | TokenFlag.ASSISTANT | TokenFlag.OUTPUT


@pytest.mark.parametrize("name", ART_0523_ALL)
def test_every_name_of_art_0523_imports_from_tracerl(name: str) -> None:
    assert hasattr(art, name) and name in art.__all__


@pytest.mark.parametrize("name", sorted(UNPORTED))
def test_an_unported_name_raises_naming_the_alternative(name: str) -> None:
    with pytest.raises(art.ConfigError, match=f"{name} is not ported.*{UNPORTED[name]}"):
        getattr(art, name)(topology={"tp": 2}) if "Megatron" in name else getattr(art, name)()


def test_unported_result_types_still_answer_isinstance() -> None:
    assert not isinstance(art.TrainResult(step=1), art.ServerlessTrainResult)


def test_the_new_names_load_nothing_heavy_at_import() -> None:
    import subprocess
    import sys

    code = ("import sys, tracerl\n"
            "print(sorted({'torch', 'transformers', 'tracerl.trajectories', 'tracerl.metrics'}"
            " & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# --- get_tokenizer -----------------------------------------------------------------------------

def test_get_tokenizer_loads_the_base_models_tokenizer(tokenizer) -> None:
    tok = art.get_tokenizer("smollm2")
    messages = [{"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(messages, tokenize=False) == \
        tokenizer.apply_chat_template(messages, tokenize=False)
    assert art.get_tokenizer("smollm2") is not tok  # fresh each call, as in ART


def test_get_tokenizer_refuses_a_revision_and_a_hub_name() -> None:
    with pytest.raises(art.ConfigError, match="revision"):
        art.get_tokenizer("smollm2", revision="main")
    with pytest.raises(art.ConfigError, match="no model hub"):
        art.get_tokenizer("Qwen/Qwen2.5-0.5B-Instruct")


# --- tokenize / tensorize ------------------------------------------------------------------------

async def _say(model: art.TrainableModel, messages: list[dict]) -> Choice:
    r = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), messages=messages, max_tokens=6)
    return r.choices[0]


@pytest.fixture(scope="module")
async def recorded(tf_backend):
    """Groups of rollouts through the gateway: one-turn, two-turn (one history) and two
    separate conversations in one rollout (two histories)."""
    _, model = tf_backend

    async def one_turn(i: int) -> None:
        messages = [{"role": "user", "content": f"Count to {i}"}]
        choice = await _say(model, messages)
        t = art.current_trajectory(require=True)
        t.messages_and_choices, t.reward = [*messages, choice], float(i)

    async def two_turns() -> None:
        messages: list = [{"role": "user", "content": "Name a color"}]
        messages.append((await _say(model, messages)).message.model_dump(exclude_none=True))
        messages.append({"role": "user", "content": "Another"})
        await _say(model, messages)

    async def two_conversations() -> None:
        await _say(model, [{"role": "user", "content": "First"}])
        await _say(model, [{"role": "system", "content": "Be brief"},
                           {"role": "user", "content": "Second"}])

    group = await art.trajectory_group([art.trajectory(one_turn(i)) for i in range(2)])
    multi_turn = await art.trajectory(two_turns())
    split = await art.trajectory(two_conversations())
    return model, group, multi_turn, split


async def test_tokenize_groups_uses_the_recorded_ids(recorded, tokenizer) -> None:
    _, group, _, _ = recorded
    (tokenized,) = await art.tokenize([group])
    assert tokenized.trajectory_group is group and len(tokenized.trajectories) == 2
    for t, source in zip(tokenized.trajectories, group.trajectories, strict=True):
        (call,) = source.llm_calls
        comp = call.completions[0]
        assert t.trajectory is source and t.reward == source.reward
        assert t.tokens == call.prompt_token_ids + comp.token_ids
        # the prompt is what the chat template gives (an oracle independent of tracerl)
        assert call.prompt_token_ids == render_ids(tokenizer, source.messages()[:1])
        n = len(call.prompt_token_ids)
        assert all(math.isnan(x) for x in t.logprobs[:n]) and t.logprobs[n:] == comp.logprobs
        assert t.flags[:n] == [TokenFlag.EXACT] * n
        assert [f & ~TokenFlag.STOP for f in t.flags[n:]] == [SAMPLED] * len(comp.token_ids)
        assert t.model == call.model and t.history.messages_and_choices
        assert TokenFlag.STOP not in t.flags[-1]  # without a tokenizer, no STOP flags (ART)


async def test_a_tokenizer_marks_the_token_that_ended_the_generation(recorded) -> None:
    model, group, _, _ = recorded
    tokenized = await art.tokenize(group.trajectories, base_model=model.base_model)
    tok = art.get_tokenizer("smollm2")
    for t, source in zip(tokenized, group.trajectories, strict=True):
        comp = source.llm_calls[0].completions[0]
        ended = comp.finish_reason == "stop" and comp.token_ids[-1] == tok.eos_token_id
        assert (TokenFlag.STOP in t.flags[-1]) == ended
        assert sum(TokenFlag.STOP in f for f in t.flags) == int(ended)


async def test_a_continued_conversation_is_one_history(recorded) -> None:
    _, _, multi_turn, _ = recorded
    (t,) = await art.tokenize([multi_turn])
    first, second = multi_turn.llm_calls
    assert t.tokens[:len(second.prompt_token_ids)] == second.prompt_token_ids
    assert t.tokens == second.prompt_token_ids + second.completions[0].token_ids
    sampled = [i for i, f in enumerate(t.flags) if TokenFlag.SAMPLED in f]
    assert len(sampled) == sum(len(c.completions[0].token_ids) for c in (first, second))


async def test_separate_conversations_need_multi_history(recorded) -> None:
    _, _, _, split = recorded
    with pytest.raises(art.InvalidTrajectoryError, match="exactly one history; found 2"):
        await art.tokenize([split])
    (t,) = await art.tokenize([split], multi_history=True)
    assert [h.tokens for h in t.histories] == [
        c.prompt_token_ids + c.completions[0].token_ids for c in split.llm_calls]
    assert [h.history.messages()[-2]["content"] for h in t.histories] == ["First", "Second"]


async def test_tensorize_gives_arts_tensors(recorded) -> None:
    _, group, _, split = recorded
    (tensors,) = await art.tensorize([group], device="cpu")
    (tokenized,) = await art.tokenize([group])
    for t, k in zip(tensors.trajectories, tokenized.trajectories, strict=True):
        assert (t.tokens.dtype, t.logprobs.dtype, t.flags.dtype) == (
            torch.int64, torch.float32, torch.int32)
        assert t.tokens.tolist() == k.tokens and t.flags.tolist() == [int(f) for f in k.flags]
        assert t.reward == k.reward
    (multi,) = await art.tensorize([split], multi_history=True)
    assert [h.tokens.ndim for h in multi.histories] == [1, 1]


async def test_a_trajectory_without_records_is_rendered(tokenizer) -> None:
    messages = [{"role": "user", "content": "Say yes"}]
    choice = Choice(index=0, finish_reason="stop",
                    message={"role": "assistant", "content": "yes"})  # type: ignore[arg-type]
    trajectory = art.Trajectory(messages_and_choices=[*messages, choice], reward=1.0)
    with pytest.raises(art.InvalidTrajectoryError, match="tokenizer= or base_model="):
        await art.tokenize([trajectory])
    (t,) = await art.tokenize([trajectory], tokenizer=tokenizer)
    prompt = render_ids(tokenizer, messages)
    answer = tokenizer("yes", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert t.tokens == prompt + answer
    assert t.flags == [TokenFlag(0)] * len(prompt) + [
        TokenFlag.ASSISTANT | TokenFlag.OUTPUT] * (len(answer) - 1) + [
        TokenFlag.ASSISTANT | TokenFlag.OUTPUT | TokenFlag.STOP]


async def test_tokenize_refuses_mixed_items(recorded) -> None:
    _, group, multi_turn, _ = recorded
    with pytest.raises(art.InvalidTrajectoryError, match="all Trajectory or all TrajectoryGroup"):
        await art.tokenize([group, multi_turn])  # type: ignore[list-item]


# --- PipelineRuntimeConfig / PipelineAutotuneConfig --------------------------------------------

async def _scripted(model, scenario: int, config) -> art.TrajectoryGroup:
    return art.TrajectoryGroup([
        art.Trajectory(reward=float(i == scenario % 2), messages_and_choices=[
            {"role": "user", "content": f"Is {scenario} even?"},
            {"index": 0, "finish_reason": "stop",
             "message": {"role": "assistant", "content": answer}}])
        for i, answer in enumerate(("yes", "no"))])


async def test_pipeline_runtime_config_sets_the_batch_and_workers(tf_backend) -> None:
    backend, _ = tf_backend
    model = art.TrainableModel(name="art0523-pipe", project="art-0523", base_model="smollm2",
                               config=art.ModelConfig(engine=art.EngineConfig(max_model_len=256)))
    trainer = art.PipelineTrainer(
        model, backend, _scripted, range(6), config=None, max_steps=1, eval_at_start=False,
        pipeline=art.PipelineRuntimeConfig(min_batch_size=3, num_rollout_workers=2),
        autotune=art.PipelineAutotuneConfig(mode="off"),
        train_config=art.TrainConfig(learning_rate=1e-4))
    assert (trainer.pipeline.groups_per_step, trainer.pipeline.num_rollout_workers) == (3, 2)
    (step,) = await trainer.train()
    assert step.step == 1 and len(step.groups) == 3


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"pipeline": art.PipelineRuntimeConfig(min_batch_size=2, max_batch_size=8)},
     "max_batch_size"),
    ({"pipeline": art.PipelineRuntimeConfig(queue_maxsize=16)}, "queue_maxsize"),
    ({"pipeline": art.PipelineRuntimeConfig(score_reference_groups_per_step=4.0)},
     "score_reference_groups_per_step"),
    ({"autotune": art.PipelineAutotuneConfig(mode="online")}, "PipelineAutotuneConfig.mode"),
    ({"pipeline": art.PipelineRuntimeConfig(min_batch_size=2), "groups_per_step": 3},
     "groups_per_step=3 disagrees"),
])
def test_pipeline_settings_without_a_knob_are_refused_by_name(kwargs: dict, field: str) -> None:
    model = art.TrainableModel(name="art0523-refused", project="art-0523", base_model="smollm2")
    with pytest.raises(art.ConfigError, match=field):
        art.PipelineTrainer(model, None, _scripted, range(2), config=None,  # type: ignore[arg-type]
                            **kwargs)


def test_pipeline_configs_validate_as_arts() -> None:
    with pytest.raises(ValueError, match="max_batch_size must be >= min_batch_size"):
        art.PipelineRuntimeConfig(min_batch_size=4, max_batch_size=2)
    with pytest.raises(ValueError, match="extra"):
        art.PipelineRuntimeConfig(num_workers=2)  # type: ignore[call-arg]


# --- metric definitions, LocalServingUnavailableError -----------------------------------------

def test_metric_sets_are_arts() -> None:
    keys = [d.key for d in art.PIPELINE_RL_METRIC_DEFINITIONS]
    assert len(keys) == len(set(keys)) == 40
    assert art.PIPELINE_RL_SCORE_METRICS == tuple(
        d.key for d in art.PIPELINE_RL_METRIC_DEFINITIONS if d.score_component)
    assert art.PIPELINE_RL_DASHBOARD_DEFAULT_METRICS[0] == "objective/score"
    custom = art.MetricDefinition(key="reward/mean", title="Reward", description="mean reward",
                                  kind="gauge", higher_is_better=True)
    assert custom.model_dump()["dashboard_default"] is False
    with pytest.raises(ValueError, match="kind"):
        art.MetricDefinition(key="k", title="t", description="d", kind="histogram")  # type: ignore[arg-type]


async def test_local_serving_unavailable_is_caught_as_in_art(smollm2_path) -> None:
    from tracerl.backend.engines.transformers_engine import TransformersEngine
    from tracerl.core.engine import PROMPT_IDS, EngineSpec

    engine = TransformersEngine(EngineSpec(smollm2_path, "base", art.EngineConfig(),
                                           art.LoraConfig()))  # never started
    try:
        await engine.chat({"model": "base", "messages": [{"role": "user", "content": "Hi"}],
                           PROMPT_IDS: [1, 2, 3], "max_tokens": 1})
    except art.LocalServingUnavailableError as e:  # ART's pipeline stops training on it
        assert isinstance(e, RuntimeError) and "not running" in str(e)
    else:
        pytest.fail("an engine that is not running answered")


# --- art.mcp ---------------------------------------------------------------------------------

TOOLS = [MCPTool(name="search_docs", description="Search the docs",
                 parameters={"type": "object", "properties": {"q": {"type": "string"}}})]


def _scenarios(n: int) -> str:
    return json.dumps({"scenarios": [{"task": f"Find page {i} and summarize it",
                                      "difficulty": i % 5 + 1} for i in range(n)]})


async def test_generate_scenarios_asks_for_structured_tasks() -> None:
    server = JudgeServer([lambda body, ids: _scenarios(4)])
    try:
        scenarios = await generate_scenarios(
            TOOLS, resources=[MCPResource(uri="docs://index", name="index", description="all")],
            num_scenarios=4, generator_model="judge", generator_api_key="k",
            generator_base_url=server.url, custom_instructions="Be terse.")
    finally:
        server.close()
    (body,) = server.requests
    schema = body["response_format"]["json_schema"]["schema"]["properties"]["scenarios"]
    assert (schema["minItems"], schema["maxItems"]) == (4, 4)
    prompt = body["messages"][0]["content"]
    assert "search_docs" in prompt and "docs://index" in prompt and "Be terse." in prompt
    train, val = scenarios.split(3)
    assert (len(train), len(val)) == (3, 1) and scenarios[0].difficulty == 1
    assert len(scenarios.filter_by_difficulty(4, 5)) == 1
    again = GeneratedScenarioCollection.from_json(scenarios.to_json())
    assert again.to_dicts() == scenarios.to_dicts()


async def test_generate_scenarios_refuses_a_wrong_answer() -> None:
    server = JudgeServer([lambda body, ids: _scenarios(2), lambda body, ids: "not json"])
    try:
        with pytest.raises(art.ConfigError, match="expected 3 scenarios, got 2"):
            await generate_scenarios(TOOLS, num_scenarios=3, generator_api_key="k",
                                     generator_base_url=server.url)
        with pytest.raises(art.ConfigError, match="not JSON"):
            await generate_scenarios(TOOLS, num_scenarios=3, generator_api_key="k",
                                     generator_base_url=server.url)
    finally:
        server.close()
    with pytest.raises(art.ConfigError, match="at least one tool or resource"):
        await generate_scenarios([], generator_api_key="k")


def test_the_default_tool_is_arts() -> None:
    assert complete_task_tool.to_tool_schema() == {"type": "function", "function": {
        "name": "complete_task", "description": "Complete a task", "parameters": {
            "type": "object", "properties": {"summary": {
                "type": "string", "description": "Summary of accomplishments"}},
            "required": ["summary"]}}}
