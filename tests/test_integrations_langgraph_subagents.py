"""Sub-agents with models of their own (issue 32): a LangGraph graph whose two nodes call two
trainable models of one base. Each call is recorded under the model that served it, the
rollout's reward is credited to both, and ``backend.train_many`` trains each model on its own
calls only, two steps, each with its own adapter on the shared base."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("langgraph")

from langchain_core.messages import HumanMessage

import tracerl
from tracerl.integrations.langchain import graph_rollout, init_chat_model

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def example_graph():
    """The graph of ``examples/langgraph_subagents.py`` (planner -> solver), as it ships."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(EXAMPLES))  # the example imports its siblings
        return importlib.import_module("langgraph_subagents").build_graph


@pytest.fixture(scope="module")
async def subagents(tf_backend):
    backend, _ = tf_backend
    planner, writer = (tracerl.TrainableModel(name=f"sub-{n}", project="tests",
                                              base_model="smollm2") for n in ("planner", "writer"))
    for m in (planner, writer):
        await m.register(backend)
    graph = example_graph()(init_chat_model(planner, temperature=1.0, max_tokens=6),
                            init_chat_model(writer, temperature=1.0, max_tokens=4))
    rollout = graph_rollout(graph, lambda inp, state: inp["reward"])  # one reward for both

    async def groups():
        return await tracerl.gather_trajectory_groups(
            [tracerl.TrajectoryGroup(
                rollout({"messages": [HumanMessage("Plan a colour.")], "reward": r})
                for r in (0.0, 1.0, 0.0, 1.0))], show_progress=False)

    first = await groups()
    results = [await backend.train_many({planner: first, writer: first},
                                        config=tracerl.TrainConfig(learning_rate=1e-3))]
    results.append(await backend.train_many({planner: await groups(), writer: await groups()},
                                            config=tracerl.TrainConfig(learning_rate=1e-3)))
    return SimpleNamespace(backend=backend, planner=planner, writer=writer, first=first,
                           results=results)


def test_each_call_is_recorded_under_the_model_that_served_it(subagents):
    for trajectory in subagents.first[0].trajectories:
        models = [c.model for c in trajectory.llm_calls]
        assert models == [subagents.planner.get_inference_name(),  # the graph's order
                          subagents.writer.get_inference_name()]
        assert trajectory.reward in (0.0, 1.0)


def test_each_model_trains_two_steps_on_its_own_calls_only(subagents):
    for step, results in enumerate(subagents.results, start=1):
        assert {m.name: r.step for m, r in results.items()} == {
            subagents.planner.name: step, subagents.writer.name: step}
    for model in (subagents.planner, subagents.writer):
        metrics = subagents.results[0][model].metrics
        own = [c for t in subagents.first[0].trajectories for c in t.llm_calls
               if c.model == model.get_inference_name()]
        assert metrics["rows"] == 4 and metrics["rendered_rows"] == 0
        assert metrics["trained_tokens"] == sum(len(c.completions[0].token_ids) for c in own)


def test_the_sub_agents_keep_separate_adapters_on_one_base(subagents):
    backend = subagents.backend
    planner, writer = (backend.policies.loaded[str(backend.store(m).root)]
                       for m in (subagents.planner, subagents.writer))
    assert planner.shared is writer.shared and planner.adapter_name != writer.adapter_name
    assert any(not (p == q).all() for p, q in zip(planner.trainable_parameters(),
                                                   writer.trainable_parameters(), strict=True))
