"""Train the model inside an existing LangGraph ReAct agent with a tool (CPU, a few steps).

`build_agent` is the user's code, unchanged; tracerl provides the chat model it gets, turns
the compiled graph into a rollout and trains on the gateway's token records.

    .venv/bin/python examples/langgraph_react_agent.py --steps 2
"""

from __future__ import annotations

import asyncio

from calculator_task import SYSTEM, answer_reward, examples, question, tool_model
from common import parse_args, train_loop
from langchain.agents import create_agent
from langchain_core.tools import tool

import tracerl
from tracerl.integrations.langchain import graph_rollout, init_chat_model


@tool
def add(a: int, b: int) -> int:
    """Add two integers"""
    return a + b


def build_agent(llm):
    """An existing agent: a ReAct loop over one tool."""
    return create_agent(llm, tools=[add], system_prompt=SYSTEM)


async def main() -> None:
    args = parse_args(__doc__)
    backend = tracerl.LocalBackend(path=args.path, engine="transformers")
    model = tool_model("langgraph-calc")
    await model.register(backend)
    graph = build_agent(init_chat_model(model, temperature=1.0, max_tokens=60))
    rollout = graph_rollout(
        graph, lambda inp, state: answer_reward(state["messages"][-1].content, inp["want"]))
    await train_loop(
        model, lambda a, b: rollout({"messages": [*examples(), question(a, b)], "want": a + b}),
        args)
    await backend.close()


if __name__ == "__main__":
    asyncio.run(main())
