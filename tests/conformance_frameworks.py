"""The framework rows of the conformance suite: agents written as each framework's docs show,
run through tracerl's adapter as a user would (``tests/test_conformance_harnesses.py`` runs
them on each engine, next to the client-library rows).

Each row is ``async row(model, env) -> Trajectory`` run as one rollout; the trajectory's
``metadata["contents"]`` holds the texts the agent saw. :data:`ROWS` gives, per row, how many
calls it makes, which calls continue which, the protocol its records name and the span-tree
check (``None``: not applicable). The tree checks assert the structure the harness implies:
one graph run with its node spans, each LLM span under its model node and paired with a
record, the tool under ``tools``; Agents SDK agent spans, LLM spans paired with records under
their agent, the function tool and the handoff between two agents; one LiteLLM span per call.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import tracerl
from examples.calculator_task import (
    ADD_TOOL,
    SYSTEM,
    as_response_items,
    examples,
    handoff_examples,
    question,
)
from tracerl.core.spans import Span

A, B = 3, 4
MAX_TOKENS = 40


class NotHere(Exception):
    """A row whose harness is not installed on this machine (reported as skipped)."""


def add_tool() -> Any:
    from langchain_core.tools import tool

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers"""
        return a + b

    return add


def graph_input() -> dict[str, Any]:
    return {"messages": [*examples(), question(A, B)]}


def texts_of(state: dict[str, Any]) -> list[str]:
    return [m.content for m in state["messages"][len(graph_input()["messages"]):]
            if m.type == "ai" and isinstance(m.content, str)]


async def graph_row(graph: Any, model: Any, config: dict[str, Any] | None = None
                    ) -> tracerl.Trajectory:
    """``graph_rollout`` on a compiled graph; the contents are the graph's AI messages."""
    from tracerl.langgraph import graph_rollout

    seen: list[str] = []

    def reward(_input: Any, state: dict[str, Any]) -> float:
        seen.extend(texts_of(state))
        return 0.0

    traj = await graph_rollout(graph, reward, config=config, model=model)(graph_input())
    traj.metadata["contents"] = seen
    return traj


# --- LangGraph / LangChain -------------------------------------------------------------------

async def langgraph_react(model: Any, env: dict[str, Any]) -> tracerl.Trajectory:
    from langgraph.prebuilt import create_react_agent

    from tracerl.langgraph import init_chat_model

    llm = init_chat_model(model, temperature=0, max_tokens=MAX_TOKENS)
    return await graph_row(create_react_agent(llm, tools=[add_tool()], prompt=SYSTEM), model)


async def langchain_create_agent(model: Any, env: dict[str, Any]) -> tracerl.Trajectory:
    from langchain.agents import create_agent

    from tracerl.langgraph import init_chat_model

    llm = init_chat_model(model, temperature=0, max_tokens=MAX_TOKENS)
    return await graph_row(create_agent(llm, tools=[add_tool()], system_prompt=SYSTEM), model)


def tool_node_graph(model: Any) -> Any:
    """The LangGraph docs' agent: a model node, a ``ToolNode``, ``tools_condition``."""
    from langchain_core.messages import SystemMessage
    from langgraph.graph import START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode, tools_condition

    from tracerl.langgraph import init_chat_model

    add = add_tool()
    llm = init_chat_model(model, temperature=0, max_tokens=MAX_TOKENS).bind_tools([add])

    async def agent(state: MessagesState) -> dict[str, Any]:
        return {"messages": [await llm.ainvoke([SystemMessage(SYSTEM), *state["messages"]])]}

    builder = StateGraph(MessagesState)
    builder.add_node("agent", agent)
    builder.add_node("tools", ToolNode([add]))
    builder.add_edge(START, "agent")
    builder.add_conditional_edges("agent", tools_condition)
    builder.add_edge("tools", "agent")
    return builder.compile()


async def langgraph_tool_node(model: Any, env: dict[str, Any]) -> tracerl.Trajectory:
    return await graph_row(tool_node_graph(model), model)


async def langgraph_astream_messages(model: Any, env: dict[str, Any]) -> tracerl.Trajectory:
    """``graph.astream(..., stream_mode="messages")`` inside ``wrap_rollout``: the tokens as
    they come, summed per message."""
    from tracerl.langgraph import wrap_rollout

    graph = tool_node_graph(model)
    texts: dict[str, str] = {}

    async def agent() -> float:
        async for chunk, meta in graph.astream(graph_input(), stream_mode="messages"):
            if meta.get("langgraph_node") == "agent" and isinstance(chunk.content, str):
                texts[chunk.id] = texts.get(chunk.id, "") + chunk.content
        return 0.0

    traj = await wrap_rollout(model, agent)()
    traj.metadata["contents"] = list(texts.values())
    return traj


async def langgraph_checkpointer(model: Any, env: dict[str, Any]) -> tracerl.Trajectory:
    """The ``tools_condition`` graph compiled with a checkpointer and one fixed thread id
    (``graph_rollout`` keeps each rollout's thread apart)."""
    from langgraph.checkpoint.memory import InMemorySaver

    graph = tool_node_graph(model)
    graph = graph.builder.compile(checkpointer=InMemorySaver())
    return await graph_row(graph, model, config={"configurable": {"thread_id": "calculator"}})


def nearest(span: Span, by_id: dict[str, Span], kind: str) -> str | None:
    """The name of ``span``'s nearest ancestor of ``kind`` (a graph node, an agent)."""
    cur = by_id.get(span.parent_id or "")
    while cur is not None and cur.kind != kind:
        cur = by_id.get(cur.parent_id or "")
    return cur.name if cur is not None else None


def graph_tree(model_node: str) -> Callable[[tracerl.Trajectory], bool]:
    """One graph run; nodes model -> tools -> model; each LLM span under the model node and
    paired with the records in order; the ``add`` tool under ``tools``."""

    def check(traj: tracerl.Trajectory) -> bool:
        by_id = {s.id: s for s in traj.spans}
        roots = [s for s in traj.spans if s.parent_id is None]
        llms = [s for s in traj.spans if s.kind == "llm"]
        tools = [s for s in traj.spans if s.kind == "tool"]
        return (len(roots) == 1
                and [s.name for s in traj.spans if s.kind == "node"]
                == [model_node, "tools", model_node]
                and [s.call_id for s in llms] == [c.id for c in traj.llm_calls]
                and all(nearest(s, by_id, "node") == model_node for s in llms)
                and [(t.name, nearest(t, by_id, "node")) for t in tools] == [("add", "tools")]
                and all(roots[0].name in (c.metadata.get("span_path") or [])[:1]
                        for c in traj.llm_calls))

    return check


# --- OpenAI Agents SDK -----------------------------------------------------------------------

def math_agent() -> Any:
    from agents import Agent, ModelSettings, function_tool

    @function_tool
    def add(a: int, b: int) -> int:
        """Add two integers"""
        return a + b

    return Agent(name="math_agent", instructions=SYSTEM, tools=[add],
                 model_settings=ModelSettings(temperature=0, max_tokens=MAX_TOKENS))


async def agents_run(model: Any, agent: Any, items: list[Any], *, use_responses: bool = False,
                     streamed: bool = False) -> tracerl.Trajectory:
    from agents import RunConfig, Runner

    from tracerl.integrations.openai_agents import TracerlModelProvider

    config = RunConfig(model_provider=TracerlModelProvider(model, use_responses=use_responses),
                       workflow_name="calculator")
    if streamed:
        result = Runner.run_streamed(agent, items, run_config=config)
        async for _ in result.stream_events():
            pass
    else:
        result = await Runner.run(agent, items, run_config=config, max_turns=6)
    texts = [item.raw_item.content[0].text for item in result.new_items
             if item.type == "message_output_item"]
    return tracerl.Trajectory(reward=0.0, metadata={"contents": texts})


def calc_items() -> list[Any]:
    return as_response_items([*examples(), question(A, B)])


async def agents_responses(model: Any, env: dict[str, Any]) -> tracerl.Trajectory:
    return await agents_run(model, math_agent(), calc_items(), use_responses=True)


async def agents_chat(model: Any, env: dict[str, Any]) -> tracerl.Trajectory:
    return await agents_run(model, math_agent(), calc_items())


async def agents_streamed(model: Any, env: dict[str, Any]) -> tracerl.Trajectory:
    return await agents_run(model, math_agent(), calc_items(), streamed=True)


async def agents_handoff(model: Any, env: dict[str, Any]) -> tracerl.Trajectory:
    from agents import Agent

    math = math_agent()
    triage = Agent(name="triage", instructions="Hand math questions to the math agent.",
                   handoffs=[math], model_settings=math.model_settings)
    items = as_response_items([*handoff_examples("math_agent"), question(A, B)])
    return await agents_run(model, triage, items)


def agents_tree(agents: list[str], handoff: bool) -> Callable[[tracerl.Trajectory], bool]:
    """The agent spans in order; every LLM span paired with a record whose span path names its
    agent; the ``add`` function tool under the math agent; the handoff span between agents."""

    def check(traj: tracerl.Trajectory) -> bool:
        by_id = {s.id: s for s in traj.spans}
        agent_spans = [s for s in traj.spans if s.kind == "agent"]
        tools = [s for s in traj.spans if s.kind == "tool"]
        handoffs = [s.name for s in traj.spans if s.kind == "handoff"]

        paired = sorted(s.call_id or "" for s in traj.spans if s.kind == "llm")
        return ([s.name for s in agent_spans] == agents
                and paired == sorted(c.id for c in traj.llm_calls)
                and all(set(agents) & set(c.metadata.get("span_path") or [])
                        for c in traj.llm_calls)
                and [(t.name, nearest(t, by_id, "agent")) for t in tools] == [("add", "math_agent")]
                and handoffs == (["triage -> math_agent"] if handoff else []))

    return check


# --- LiteLLM ---------------------------------------------------------------------------------

async def litellm_sdk(model: Any, env: dict[str, Any]) -> tracerl.Trajectory:
    """``litellm.acompletion`` with ``completion_kwargs`` (the logger is in
    ``litellm.callbacks``, set by the suite once)."""
    import litellm

    from tracerl.integrations.litellm import completion_kwargs

    messages: list[Any] = [{"role": "system", "content": SYSTEM}, *examples(), question(A, B)]
    contents = []
    for max_tokens in (MAX_TOKENS, 16):
        response = await litellm.acompletion(messages=messages, tools=[ADD_TOOL], temperature=0,
                                             max_tokens=max_tokens, **completion_kwargs(model))
        message = response.choices[0].message
        contents.append(message.content or "")
        if not message.tool_calls:
            break
        call = message.tool_calls[0]
        args = json.loads(call.function.arguments)
        made = {"id": call.id, "type": "function",
                "function": {"name": "add", "arguments": call.function.arguments}}
        messages += [{"role": "assistant", "content": message.content or None,
                      "tool_calls": [made]},
                     {"role": "tool", "tool_call_id": call.id,
                      "content": str(args["a"] + args["b"])}]
    return tracerl.Trajectory(reward=0.0, metadata={"contents": contents})


def litellm_tree(framework: str) -> Callable[[tracerl.Trajectory], bool]:
    """One LiteLLM ``llm`` span per call (the SDK's logger, the proxy's callback), each paired
    with its own record."""

    def check(traj: tracerl.Trajectory) -> bool:
        llms = [s for s in traj.spans if s.kind == "llm" and s.framework == framework]
        return (len(llms) == len(traj.spans) == len(traj.llm_calls)
                and all(c.metadata.get("span_id") == s.id and s.call_id == c.id
                        for s, c in zip(llms, traj.llm_calls, strict=True)))

    return check


async def litellm_proxy(model: Any, env: dict[str, Any]) -> tracerl.Trajectory:
    """The openai client against ``tracerl proxy`` (a LiteLLM proxy), the rollout named by the
    ``x-rollout-id`` header from ``tracerl.rollout_headers(model)``, as the README shows (it
    also tells the rollout which model serves it); its records and the spans the proxy posts
    after each response come back by rollout id (awaited here)."""
    from tests.conftest import until
    from tests.test_conformance_harnesses import openai_chat
    from tracerl.core.context import current_rollout

    if env["proxy"] is None:
        raise NotHere("TRACERL_LITELLM_PYTHON (a venv with LiteLLM's proxy) is not set")
    proxy = await env["proxy"]
    rollout = current_rollout()
    assert rollout is not None
    contents = await openai_chat(proxy.base_url.removesuffix("/v1"), proxy.master_key,
                                 model.name, False, headers=tracerl.rollout_headers(model))

    async def posted() -> bool:
        return len(await model.fetch_spans(rollout.rollout_id)) >= len(contents)

    await until(posted, "the proxy's spans of the rollout", timeout_s=30, every_s=0.1)
    return tracerl.Trajectory(reward=0.0, metadata={"contents": contents})


@dataclass(frozen=True)
class Row:
    run: Callable[[Any, dict[str, Any]], Awaitable[tracerl.Trajectory]] | None = None  # agent
    calls: int = 2  # how many calls the harness makes
    continues: tuple[tuple[int, int], ...] = ((0, 1),)  # (earlier, later) calls of one agent
    protocol: str | None = None
    span_tree: Callable[[tracerl.Trajectory], bool] | None = None


ROWS: dict[str, Row] = {
    "langgraph create_react_agent": Row(langgraph_react, span_tree=graph_tree("agent")),
    "langchain create_agent": Row(langchain_create_agent, span_tree=graph_tree("model")),
    "langgraph StateGraph + ToolNode": Row(langgraph_tool_node, span_tree=graph_tree("agent")),
    "langgraph astream messages": Row(langgraph_astream_messages,
                                      span_tree=graph_tree("agent")),
    "langgraph checkpointer": Row(langgraph_checkpointer, span_tree=graph_tree("agent")),
    "agents-sdk responses (default API)": Row(agents_responses, protocol="responses",
                                              span_tree=agents_tree(["math_agent"], False)),
    "agents-sdk chat provider + function tool": Row(
        agents_chat, span_tree=agents_tree(["math_agent"], False)),
    "agents-sdk handoff": Row(agents_handoff, calls=3, continues=((1, 2),),
                              span_tree=agents_tree(["triage", "math_agent"], True)),
    "agents-sdk run_streamed": Row(agents_streamed,
                                   span_tree=agents_tree(["math_agent"], False)),
    "litellm sdk": Row(litellm_sdk, span_tree=litellm_tree("litellm")),
    "litellm proxy": Row(litellm_proxy, span_tree=litellm_tree("litellm-proxy")),
}
