"""OpenAI Agents SDK adapter against the real SDK, the real gateway and SmolLM2."""

from __future__ import annotations

import json
import socket
from types import SimpleNamespace

import pytest

pytest.importorskip("agents")

from agents import Agent, ModelSettings, RunConfig, Runner, function_tool

import tracerl
from examples.calculator_task import (
    SYSTEM,
    as_response_items,
    examples,
    handoff_examples,
    question,
)
from tests.conftest import render_ids
from tracerl.backend.chat_template import apply_chat_template_override
from tracerl.integrations.openai_agents import (
    BYPASS_FIX,
    TracerlModelProvider,
    TracerlTracingProcessor,
    install_tracing,
)

SETTINGS = ModelSettings(temperature=0, max_tokens=60)


@function_tool
def add(a: int, b: int) -> int:
    """Add two integers"""
    return a + b


def make_agents(tools=(add,)):
    math = Agent(name="math_agent", instructions=SYSTEM, tools=list(tools), model_settings=SETTINGS)
    triage = Agent(name="triage", instructions="Hand math questions to the math agent.",
                   handoffs=[math], model_settings=SETTINGS)
    return triage


def _dns_tripwire(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Fail (and remember) any name lookup that is not loopback: nothing may be uploaded."""
    seen = []
    real = socket.getaddrinfo

    def guarded(host, *args, **kwargs):
        if host not in ("127.0.0.1", "localhost", "::1"):
            seen.append(host)
            raise OSError(f"test tripwire: lookup of {host}")
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", guarded)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-dummy-would-trigger-upload")
    return seen


SUMS = [(3, 4), (5, 3)]


@pytest.fixture(scope="module")
async def handoff_run(agent_model):
    """Two concurrent rollouts (batched together by the engine) of a triage agent handing off
    to a math agent with a tool; the 135M model does so reliably for these sums (greedy)."""
    provider = TracerlModelProvider(agent_model)
    triage = make_agents()

    async def rollout(a: int, b: int) -> tracerl.Trajectory:
        result = await Runner.run(
            triage,
            as_response_items([*handoff_examples("math_agent"), question(a, b)]),
            run_config=RunConfig(model_provider=provider, workflow_name="calc"),
            max_turns=6,
        )
        return tracerl.Trajectory(reward=float(str(a + b) in result.final_output),
                                  metadata={"last_agent": result.last_agent.name})

    with pytest.MonkeyPatch.context() as mp:
        lookups = _dns_tripwire(mp)
        (group,) = await tracerl.gather_trajectory_groups(
            [tracerl.TrajectoryGroup(rollout(a, b) for a, b in SUMS)], show_progress=False)
    return SimpleNamespace(group=group, lookups=lookups)


def _each(run):
    yield from zip(SUMS, run.group.trajectories, strict=True)


async def test_handoff_rollouts_end_with_the_math_agent_and_the_sum(handoff_run):
    assert handoff_run.group.exceptions == []
    for _, traj in _each(handoff_run):
        assert traj.reward == 1.0 and traj.metadata["last_agent"] == "math_agent"


async def test_each_agent_turn_is_recorded_with_its_tool_calls(handoff_run):
    for (a, b), traj in _each(handoff_run):
        _handoff, tool_call, answer = traj.llm_calls
        names = [[t["function"]["name"] for t in c.completions[0].tool_calls or []]
                 for c in traj.llm_calls]
        assert names == [["transfer_to_math_agent"], ["add"], []]
        args = json.loads(tool_call.completions[0].tool_calls[0]["function"]["arguments"])
        assert args == {"a": a, "b": b} and str(a + b) in answer.completions[0].text


async def test_agent_prompts_are_recorded_as_the_served_template_renders_them(
        handoff_run, tokenizer):
    tok = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    apply_chat_template_override(tok, "chatml-tools")
    for _, traj in _each(handoff_run):
        for call in traj.llm_calls:
            assert call.prompt_token_ids == render_ids(tok, call.request["messages"],
                                                       call.request.get("tools"))


async def test_sdk_spans_record_agents_handoff_and_tool(handoff_run):
    for (a, b), traj in _each(handoff_run):
        kinds = [s.kind for s in traj.spans]
        assert (kinds.count("agent"), kinds.count("handoff"), kinds.count("tool")) == (2, 1, 1)
        (h,) = [s for s in traj.spans if s.kind == "handoff"]
        assert h.name == "triage -> math_agent"
        (t,) = [s for s in traj.spans if s.kind == "tool"]
        assert t.name == "add" and t.attributes["output"] == str(a + b)


async def test_every_generation_pairs_with_its_record_under_its_agent(handoff_run):
    for _, traj in _each(handoff_run):
        spans = {s.id: s for s in traj.spans}
        assert [c.metadata["span_path"][2] for c in traj.llm_calls] == [
            "triage", "math_agent", "math_agent"]
        assert {s.call_id for s in traj.spans if s.kind == "llm"} == {c.id for c in traj.llm_calls}
        assert spans[traj.llm_calls[0].metadata["span_id"]].kind == "llm"


async def test_no_trace_upload_is_attempted(handoff_run):
    assert handoff_run.lookups == []


@pytest.fixture(scope="module")
async def streamed_run(agent_model):
    """One streamed run of the math agent (a tool call, then the answer) in a rollout."""
    provider = TracerlModelProvider(agent_model)
    agent = Agent(name="math_agent", instructions=SYSTEM, tools=[add], model_settings=SETTINGS)
    with tracerl.rollout_scope() as ro:
        result = Runner.run_streamed(agent, as_response_items([*examples(), question(8, 9)]),
                                     run_config=RunConfig(model_provider=provider))
        async for _ in result.stream_events():
            pass
    calls = await agent_model.fetch_calls(ro.rollout_id)
    return SimpleNamespace(calls=calls, final_output=result.final_output)


async def test_a_streamed_run_records_each_turn_as_streamed(streamed_run):
    assert [c.streamed for c in streamed_run.calls] == [True, True]


async def test_a_streamed_run_calls_the_tool_then_answers(streamed_run):
    assert streamed_run.calls[0].completions[0].tool_calls
    assert "17" in streamed_run.final_output


async def test_a_streamed_runs_records_have_a_logprob_per_token(streamed_run):
    for call in streamed_run.calls:
        assert len(call.completions[0].logprobs) == len(call.completions[0].token_ids) > 0


@pytest.fixture(scope="module")
async def group_with_a_tool_crash(agent_model):
    """Two rollouts; the tool raises in the first (13 is unlucky), not in the second."""
    provider = TracerlModelProvider(agent_model)

    @function_tool(failure_error_function=None)
    def add(a: int, b: int) -> int:
        """Add two integers"""
        if a == 13:
            raise ValueError("unlucky number")
        return a + b

    triage = make_agents(tools=(add,))

    async def rollout(a: int, b: int) -> tracerl.Trajectory:
        result = await Runner.run(
            triage,
            as_response_items([*handoff_examples("math_agent"), question(a, b)]),
            run_config=RunConfig(model_provider=provider),
        )
        return tracerl.Trajectory(reward=float(str(a + b) in result.final_output))

    (group,) = await tracerl.gather_trajectory_groups(
        [tracerl.TrajectoryGroup([rollout(13, 1), rollout(4, 4)])],
        max_exceptions=1,
        show_progress=False,
    )
    return group


async def test_a_tool_crash_fails_only_its_rollout(group_with_a_tool_crash):
    assert [t.reward for t in group_with_a_tool_crash.trajectories] == [1.0]


async def test_a_tool_crash_keeps_the_tools_own_exception(group_with_a_tool_crash):
    (exc,) = group_with_a_tool_crash.exceptions
    # the tool's own exception, chained under whatever the SDK raised
    assert "ValueError: unlucky number" in exc.traceback


def test_other_model_names_are_refused_clearly(agent_model):
    provider = TracerlModelProvider(agent_model, tracing=False)
    with pytest.raises(ValueError, match=r"gpt-4o.*fallback"):
        provider.get_model("gpt-4o")


def test_a_step_of_the_model_can_be_named(agent_model):
    provider = TracerlModelProvider(agent_model, tracing=False)
    # sent qualified, so another project's `agent` cannot make it ambiguous
    assert provider.get_model("agent@3").inner.model == "tests/agent@3"
    assert provider.get_model("tests/agent@3").inner.model == "tests/agent@3"


async def test_per_rollout_providers_share_one_processor_and_close_every_span(agent_model):
    agent = Agent(name="echo", instructions="Answer briefly.",
                  model_settings=ModelSettings(temperature=0, max_tokens=4))

    async def rollout(word: str) -> tracerl.Trajectory:
        provider = TracerlModelProvider(agent_model)  # made per rollout, as users do
        await Runner.run(agent, f"Say {word}", run_config=RunConfig(model_provider=provider))
        return tracerl.Trajectory(reward=0.0)

    (group,) = await tracerl.gather_trajectory_groups(
        [tracerl.TrajectoryGroup(rollout(w) for w in ("yes", "no"))], show_progress=False)
    assert TracerlModelProvider(agent_model).processor is install_tracing()
    for traj in group.trajectories:
        assert traj.spans and all(s.end_time is not None for s in traj.spans)


async def test_an_agent_holding_its_own_model_instance_is_warned_about(agent_model, caplog):
    import openai
    from agents import OpenAIChatCompletionsModel

    base_url, api_key = agent_model.endpoint()
    own = OpenAIChatCompletionsModel(  # bypasses the provider: a plain client of its own
        model=agent_model.get_inference_name(),
        openai_client=openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0))
    agent = Agent(name="own", instructions="Answer briefly.", model=own,
                  model_settings=ModelSettings(temperature=0, max_tokens=4))
    provider = TracerlModelProvider(agent_model)
    before = provider.processor.bypassed_calls
    with tracerl.rollout_scope(), caplog.at_level("WARNING"):
        await Runner.run(agent, "Say yes", run_config=RunConfig(model_provider=provider))
    assert provider.processor.bypassed_calls == before + 1
    assert "bypassed TracerlModelProvider" in caplog.text and BYPASS_FIX in caplog.text


async def test_adding_tracerls_processor_beside_the_default_turns_the_upload_off():
    from agents.tracing import add_trace_processor, get_trace_provider, set_trace_processors, trace
    from agents.tracing.processors import default_processor

    processor = TracerlTracingProcessor()
    set_trace_processors([default_processor()])  # the SDK's own setup: upload to OpenAI
    add_trace_processor(processor)
    try:
        with trace("check"):
            pass
        processors = get_trace_provider()._multi_processor._processors
        assert default_processor() not in processors and processor in processors
    finally:
        install_tracing()
