"""LangGraph / LangChain adapter against real LangGraph, the real gateway and SmolLM2."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("langgraph")

from langchain.agents import create_agent
from langchain_core.runnables import RunnableLambda
from langchain_core.tools import tool
from langgraph.graph import END, START, MessagesState, StateGraph

import tracerl
from examples.calculator_task import SYSTEM, examples, question
from tests.conftest import render_ids
from tracerl.backend.chat_template import apply_chat_template_override
from tracerl.integrations.langchain import (
    TracerlCallbackHandler,
    graph_rollout,
    init_chat_model,
    wrap_rollout,
)


@tool
def add(a: int, b: int) -> int:
    """Add two integers"""
    return a + b


def final_text(state) -> str:
    return state["messages"][-1].content or ""


def answer_reward(graph_input, state) -> tuple[float, dict[str, float]]:
    ok = str(graph_input["want"]) in final_text(state)
    last_question = max(i for i, m in enumerate(state["messages"]) if m.type == "human")
    tools = sum(m.type == "tool" for m in state["messages"][last_question:])
    return float(ok), {"tool_messages": float(tools)}


def calc_input(a: int, b: int, parallel: bool = False) -> dict:
    return {"messages": [*examples(parallel), question(a, b)], "want": a + b}


@pytest.fixture(scope="module")
def react_graph(agent_model):
    llm = init_chat_model(agent_model, temperature=0, max_tokens=60)
    return create_agent(llm, tools=[add], system_prompt=SYSTEM)


SUMS = [(3, 4), (12, 30)]


@pytest.fixture(scope="module")
async def react_groups(react_graph, agent_model):
    """Two groups of two ReAct rollouts (a tool call, then the answer) on the compiled graph."""
    rollout = graph_rollout(react_graph, answer_reward)
    return await tracerl.gather_trajectory_groups(
        [tracerl.TrajectoryGroup(rollout(calc_input(a, b)) for _ in range(2)) for a, b in SUMS],
        show_progress=False)


def _each(groups):
    for (a, b), group in zip(SUMS, groups, strict=True):
        for traj in group.trajectories:
            yield a, b, traj


async def test_react_rollouts_finish_rewarded_without_exceptions(react_groups):
    assert [g.exceptions for g in react_groups] == [[], []]
    for _, _, traj in _each(react_groups):
        assert traj.reward == 1.0 and traj.metrics["tool_messages"] == 1.0
        assert traj.metadata["framework"] == "langgraph"


async def test_each_model_turn_of_a_rollout_has_its_own_record(react_groups):
    for a, b, traj in _each(react_groups):
        first, second = traj.llm_calls  # the tool call, then the answer
        (tc,) = first.response["choices"][0]["message"]["tool_calls"]
        assert json.loads(tc["function"]["arguments"]) == {"a": a, "b": b}
        assert first.completions[0].tool_calls
        assert first.completions[0].finish_reason == "tool_calls"
        assert f"{a} plus {b}" in first.request["messages"][-1]["content"]  # its own rollout's
        assert second.request["messages"][-1] == {"role": "tool", "content": str(a + b),
                                                  "tool_call_id": tc["id"]}


async def test_recorded_prompt_ids_are_the_served_templates_rendering(react_groups, tokenizer):
    tokenizer = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    apply_chat_template_override(tokenizer, "chatml-tools")
    for _, _, traj in _each(react_groups):
        for call in traj.llm_calls:
            assert call.prompt_token_ids == render_ids(tokenizer, call.request["messages"],
                                                       call.request.get("tools"))
            assert len(call.completions[0].logprobs) == len(call.completions[0].token_ids) > 0


async def test_spans_mirror_the_graph_and_pair_with_the_records(react_groups):
    for a, b, traj in _each(react_groups):
        first, second = traj.llm_calls
        by_kind = {}
        for s in traj.spans:
            by_kind.setdefault(s.kind, []).append(s)
        # graph -> model node -> chat model; graph -> tools node -> add
        assert [s.name for s in by_kind["node"]] == ["model", "tools", "model"]
        (tool_span,) = by_kind["tool"]
        assert tool_span.name == "add" and tool_span.attributes["output"] == str(a + b)
        assert [s.call_id for s in by_kind["llm"]] == [first.id, second.id]
        assert first.metadata["span_path"][-2:] == ["model", "ChatOpenAI"]
        assert by_kind["llm"][0].attributes["tool_calls"] == ["add"]


async def test_the_trajectory_keeps_the_conversation_langgraph_ended_with(react_groups):
    for a, b, traj in _each(react_groups):
        assert traj.messages_and_choices[-1]["role"] == "assistant"
        assert str(a + b) in traj.messages_and_choices[-1]["content"]


@pytest.fixture(scope="module")
async def parallel_run(agent_model):
    """One streamed rollout whose first turn asks for two tool calls at once."""
    llm = init_chat_model(agent_model, temperature=0, max_tokens=80, streaming=True)
    graph = create_agent(llm, tools=[add], system_prompt=SYSTEM)
    return await graph_rollout(graph, lambda i, s: 0.0)(
        {
            "messages": [
                *examples(parallel=True),
                {"role": "user", "content": "What is 3 plus 4 and 8 plus 1?"},
            ]
        }
    )


async def test_a_streamed_langchain_call_is_recorded_as_streamed(parallel_run):
    assert parallel_run.llm_calls[0].streamed


async def test_parallel_tool_calls_are_recorded_in_one_turn(parallel_run):
    calls = parallel_run.llm_calls[0].response["choices"][0]["message"]["tool_calls"]
    assert [json.loads(tc["function"]["arguments"]) for tc in calls] == [
        {"a": 3, "b": 4}, {"a": 8, "b": 1}]


async def test_each_parallel_tool_call_runs_under_its_own_tools_node(parallel_run):
    # LangGraph runs each parallel call as its own `tools` task (Send)
    tools = [s for s in parallel_run.spans if s.kind == "tool"]
    by_id = {s.id: s for s in parallel_run.spans}
    assert sorted(s.attributes["output"] for s in tools) == ["7", "9"]
    assert [by_id[s.parent_id].name for s in tools] == ["tools", "tools"]
    assert len({s.parent_id for s in tools}) == 2


async def test_every_llm_span_of_a_streamed_run_is_paired_with_its_record(parallel_run):
    # (was `all(s.call_id ...)`, true of no llm spans at all)
    call_ids = [s.call_id for s in parallel_run.spans if s.kind == "llm"]
    assert sorted(call_ids) == sorted(c.id for c in parallel_run.llm_calls)


def _failing_graph(agent_model):
    llm = init_chat_model(agent_model, temperature=0, max_tokens=8)

    async def call_model(state: MessagesState):
        reply = await llm.ainvoke(state["messages"])  # no config passed: contextvars carry it
        if "fail" in state["messages"][-1].content:
            raise RuntimeError("tool backend exploded")
        return {"messages": [reply]}

    builder = StateGraph(MessagesState)
    builder.add_node("call_model", call_model)
    builder.add_edge(START, "call_model")
    builder.add_edge("call_model", END)
    return builder.compile()


@pytest.fixture(scope="module")
async def group_with_a_failure(agent_model):
    rollout = graph_rollout(_failing_graph(agent_model), lambda i, s: 1.0)
    (group,) = await tracerl.gather_trajectory_groups(
        [
            tracerl.TrajectoryGroup(
                [
                    rollout({"messages": [{"role": "user", "content": "hi"}]}),
                    rollout({"messages": [{"role": "user", "content": "please fail"}]}),
                ]
            )
        ],
        max_exceptions=1,
        show_progress=False,
    )
    return group


async def test_a_framework_error_fails_only_its_rollout(group_with_a_failure):
    assert [t.reward for t in group_with_a_failure.trajectories] == [1.0]


async def test_a_framework_error_is_recorded_in_the_group(group_with_a_failure):
    (exc,) = group_with_a_failure.exceptions
    assert exc.type == "RuntimeError" and "tool backend exploded" in exc.message


async def test_the_surviving_rollouts_node_span_has_no_error(group_with_a_failure):
    (survivor,) = group_with_a_failure.trajectories
    nodes = [s for s in survivor.spans if s.kind == "node"]
    assert [(s.name, s.error) for s in nodes] == [("call_model", None)]


async def test_wrap_rollout_builds_the_trajectory_from_records(agent_model):
    llm = init_chat_model(agent_model, temperature=0, max_tokens=6)

    async def my_agent(text: str) -> float:
        reply = await llm.ainvoke([{"role": "user", "content": text}])
        return float(len(reply.content) > 0)

    rollout = wrap_rollout(agent_model, my_agent)
    trajs = await asyncio.gather(*(rollout(f"Say {w}") for w in ("yes", "no")))
    for word, traj in zip(("yes", "no"), trajs, strict=True):
        (call,) = traj.llm_calls
        assert traj.messages_and_choices[0] == {"role": "user", "content": f"Say {word}"}
        choice = traj.messages_and_choices[-1]
        assert choice.message.content == call.completions[0].text
        assert traj.spans[0].call_id == call.id


def handler_types(_input, config) -> list[str]:
    """What a LangChain run sees: the types of the callback handlers it was configured with."""
    return [type(h).__name__ for h in config["callbacks"].handlers]


async def test_outside_rollouts_no_handler_is_installed(agent_model):
    # (this was claimed by a bare `await llm.ainvoke("hello")` that asserted nothing)
    init_chat_model(agent_model)  # installs the automatic handler for rollouts
    assert await RunnableLambda(handler_types).ainvoke(None) == []


async def test_inside_a_rollout_the_handler_is_installed(agent_model):
    init_chat_model(agent_model)
    with tracerl.rollout_scope():
        assert await RunnableLambda(handler_types).ainvoke(None) == ["TracerlCallbackHandler"]


async def test_an_explicit_handler_outside_rollouts_keeps_its_spans(agent_model):
    llm = init_chat_model(agent_model, temperature=0, max_tokens=4)
    handler = TracerlCallbackHandler()
    await llm.ainvoke("hello", config={"callbacks": [handler]})
    (span,) = handler.orphans
    assert span.kind == "llm" and span.response_id and span.end_time


async def test_a_chat_model_made_in_the_first_rollout_records_that_rollouts_spans(agent_model):
    from tracerl.events.plugins import get_plugin_manager

    get_plugin_manager().unregister(name="langchain")  # as in a fresh process
    with tracerl.rollout_scope() as ro:  # started before any init_chat_model
        await init_chat_model(agent_model, temperature=0, max_tokens=2).ainvoke("hi")
    assert [s.kind for s in ro.spans] == ["llm"]  # (was [] : the first rollout lost its spans)


async def test_inside_a_rollout_an_explicit_handler_is_not_doubled(agent_model):
    llm = init_chat_model(agent_model, temperature=0, max_tokens=4)
    with tracerl.rollout_scope() as ro:
        await llm.ainvoke("hi", config={"callbacks": [TracerlCallbackHandler()]})
    assert [s.kind for s in ro.spans] == ["llm"]


async def test_art_style_init_chat_model_takes_its_model_from_wrap_rollout(agent_model):
    from tracerl import langgraph as art_langgraph

    async def my_agent(text: str) -> float:
        llm = art_langgraph.init_chat_model(temperature=0, max_tokens=4)  # ART: no model here
        named = art_langgraph.init_chat_model("any-name", temperature=0, max_tokens=4)
        for chat in (llm, named):
            await chat.ainvoke([{"role": "user", "content": text}])
        return 1.0

    traj = await art_langgraph.wrap_rollout(agent_model, my_agent)("Say yes")
    assert [call.model for call in traj.llm_calls] == [agent_model.get_inference_name()] * 2


async def test_art_style_init_chat_model_outside_wrap_rollout_binds_inside_one(agent_model):
    from tracerl import langgraph as art_langgraph

    llm = art_langgraph.init_chat_model(temperature=0, max_tokens=2)  # no model yet: lazy
    traj = await art_langgraph.wrap_rollout(agent_model, lambda: _say(llm))()
    assert [call.model for call in traj.llm_calls] == [agent_model.get_inference_name()]


async def _say(llm) -> float:
    await llm.ainvoke("Say yes")
    return 1.0


# a module-level chat model, as LangChain's docs write it: bound to the rollout's model per call
LAZY_LLM = init_chat_model("openai:gpt-4o", temperature=0, max_tokens=8)


@pytest.fixture(scope="module")
async def checkpointed_group(agent_model):
    """Two rollouts of one StateGraph with a checkpointer and one fixed config, chat model
    made at import time (before any tracerl model existed)."""
    from langgraph.checkpoint.memory import InMemorySaver

    async def call(state: MessagesState) -> dict:
        return {"messages": [await LAZY_LLM.ainvoke(state["messages"])]}

    builder = StateGraph(MessagesState)
    builder.add_node("call", call)
    builder.add_edge(START, "call")
    builder.add_edge("call", END)
    graph = builder.compile(checkpointer=InMemorySaver())
    rollout = graph_rollout(graph, lambda i, s: 0.0, model=agent_model,
                            config={"tags": ["lazy"]})
    (group,) = await tracerl.gather_trajectory_groups(
        [tracerl.TrajectoryGroup(rollout({"messages": [("user", f"Say {w}")]})
                                 for w in ("yes", "no"))], show_progress=False)
    return graph, group


async def test_a_module_level_init_chat_model_binds_to_the_rollouts_model(checkpointed_group):
    _, group = checkpointed_group
    assert group.exceptions == []
    for traj in group.trajectories:
        (call,) = traj.llm_calls
        assert call.request["model"] != "gpt-4o"  # served by the tracerl model, not the name


async def test_each_checkpointed_rollout_gets_its_own_thread(checkpointed_group):
    graph, group = checkpointed_group
    for traj, word in zip(group.trajectories, ("yes", "no"), strict=True):
        state = await graph.aget_state({"configurable": {"thread_id": traj.rollout_id}})
        humans = [m.content for m in state.values["messages"] if m.type == "human"]
        assert humans == [f"Say {word}"]  # only its own conversation, never the other's


async def test_a_lazy_chat_model_called_outside_a_rollout_says_how_to_bind_it():
    with pytest.raises(RuntimeError, match="graph_rollout\\(graph, reward, model=model\\)"):
        await LAZY_LLM.ainvoke("hi")


def test_a_fixed_thread_id_is_kept_apart_per_rollout(agent_model):
    from langgraph.checkpoint.memory import InMemorySaver

    from tracerl.integrations.langchain import rollout_config

    graph = StateGraph(MessagesState)
    graph.add_node("n", lambda s: {})
    graph.add_edge(START, "n")
    compiled = graph.compile(checkpointer=InMemorySaver())
    fixed = {"configurable": {"thread_id": "t"}}
    with tracerl.rollout_scope() as a:
        first = rollout_config(compiled, fixed, None)
    with tracerl.rollout_scope() as b:
        second = rollout_config(compiled, fixed, None)
        per_input = rollout_config(compiled, lambda i: {"configurable": {"thread_id": i}}, "x")
    assert first["configurable"]["thread_id"] == f"t/{a.rollout_id}"
    assert second["configurable"]["thread_id"] == f"t/{b.rollout_id}"
    assert per_input["configurable"]["thread_id"] == "x"  # a per-rollout config is the user's
    assert fixed == {"configurable": {"thread_id": "t"}}  # the given config is not changed


async def test_the_viewer_shows_a_langgraph_rollouts_span_tree(react_groups, tmp_path):
    """The live viewer on a folder holding real LangGraph rollouts: the trajectory's span tree
    is the graph's (nodes, tool, chat model calls), each llm span naming a call the page lists,
    and the page draws it in a real headless Chromium."""
    import shutil
    import subprocess
    import urllib.request

    from tracerl.core.trajectory import write_groups_jsonl
    from tracerl.viewer import Viewer

    (tmp_path / "history.jsonl").write_text(json.dumps({"step": 0, "split": "val"}) + "\n")
    write_groups_jsonl(tmp_path / "trajectories" / "val" / "0000.jsonl", react_groups)
    with Viewer(tmp_path) as viewer:
        url = viewer.url.rstrip("/")
        with urllib.request.urlopen(f"{url}/api/trajectory/val/0/0/0", timeout=30) as r:
            shown = json.loads(r.read())
        kinds = [s["kind"] for s in shown["spans"]]
        assert [s["name"] for s in shown["spans"] if s["kind"] == "node"] == [
            "model", "tools", "model"]
        assert "tool" in kinds
        assert [s["call_id"] for s in shown["spans"] if s["kind"] == "llm"] == [
            c["id"] for c in shown["calls"]]
        chromium = shutil.which("chromium") or shutil.which("chromium-browser")
        if chromium is None:
            pytest.skip("Debian's chromium is not installed (apt-get install chromium)")
        page = subprocess.run(
            [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             f"--user-data-dir={tmp_path / 'chromium'}", "--virtual-time-budget=10000",
             "--dump-dom", f"{url}/#traj=val/0/0/0"],
            capture_output=True, text=True, timeout=120)
    dom = page.stdout
    assert "<h3>Spans</h3>" in dom, page.stderr[-2000:]
    assert "node <b>tools</b>" in dom and "tool <b>add</b>" in dom
