"""Two sub-agents of one LangGraph graph, each with a trainable model of its own, trained side
by side on one base (CPU, a few steps).

The planner restates the problem, the solver answers from the plan. Each node's chat model is
served by its own model; every call is recorded under the model that served it, and
``backend.train_many`` trains both in one step, each on its own calls, with one copy of the
base weights in the trainer. The solver gets the rollout's reward; the planner gets it too
(the default), or, with ``--planner-reward own``, a reward of its own: whether its plan names
both numbers.

    .venv/bin/python examples/langgraph_subagents.py --steps 2
"""

from __future__ import annotations

import asyncio
import re

from calculator_task import answer_reward, rng_sums
from common import parse_args
from langchain_core.messages import HumanMessage
from langgraph.graph import END, START, MessagesState, StateGraph

import tracerl
from tracerl.integrations.langchain import graph_rollout, init_chat_model


def build_graph(planner_llm, solver_llm):
    """An existing two-agent graph: planner -> solver."""
    async def planner(state: MessagesState) -> dict:
        prompt = [*state["messages"], HumanMessage("Restate the numbers to add, briefly.")]
        return {"messages": [await planner_llm.ainvoke(prompt)]}

    async def solver(state: MessagesState) -> dict:
        prompt = [*state["messages"], HumanMessage("Now give only the sum.")]
        return {"messages": [await solver_llm.ainvoke(prompt)]}

    g = StateGraph(MessagesState)
    g.add_node("planner", planner)
    g.add_node("solver", solver)
    g.add_edge(START, "planner")
    g.add_edge("planner", "solver")
    g.add_edge("solver", END)
    return g.compile()


def plan_reward(trajectory: tracerl.Trajectory, a: int, b: int) -> float:
    """The planner's own reward: its plan (the first recorded call's answer) names a and b."""
    plan = trajectory.llm_calls[0].completions[0].text if trajectory.llm_calls else ""
    numbers = {int(x) for x in re.findall(r"-?\d+", plan)}
    return float(a in numbers) + float(b in numbers)


async def main() -> None:
    import argparse

    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--planner-reward", choices=["shared", "own"], default="shared")
    own, rest = extra.parse_known_args()
    import sys

    sys.argv = [sys.argv[0], *rest]
    args = parse_args(__doc__)
    backend = tracerl.LocalBackend(path=args.path, engine="transformers")
    planner, solver = (tracerl.TrainableModel(name=n, project="subagents", base_model="smollm2")
                       for n in ("planner", "solver"))
    for m in (planner, solver):
        await m.register(backend)
    graph = build_graph(init_chat_model(planner, temperature=1.0, max_tokens=24),
                        init_chat_model(solver, temperature=1.0, max_tokens=8))
    rollout = graph_rollout(graph, lambda inp, state: answer_reward(
        state["messages"][-1].content, inp["want"]))
    for step in range(await solver.get_step(), args.steps):
        sums = rng_sums(args.groups, seed=step)
        groups = await tracerl.gather_trajectory_groups(
            (tracerl.TrajectoryGroup(
                rollout({"messages": [HumanMessage(f"What is {a} + {b}?")], "want": a + b})
                for _ in range(args.group_size)) for a, b in sums),
            max_exceptions=0.5, pbar_desc=f"step {step + 1}")
        planner_groups = groups
        if own.planner_reward == "own":  # the same rollouts, credited by the planner's reward
            planner_groups = [tracerl.TrajectoryGroup(
                [t.model_copy(update={"reward": plan_reward(t, a, b)}) for t in g.trajectories])
                for g, (a, b) in zip(groups, sums, strict=True)]
        results = await backend.train_many({planner: planner_groups, solver: groups},
                                           config=tracerl.TrainConfig(learning_rate=5e-5))
        for m, result in results.items():
            print(f"step {step + 1} {m.name}: loss {result.metrics.get('loss', 0.0):.4f} "
                  f"trained tokens {result.metrics.get('trained_tokens', 0):.0f}")
    await backend.close()


if __name__ == "__main__":
    asyncio.run(main())
