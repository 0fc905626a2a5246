"""ART's LangGraph page (docs: integrations/langgraph-integration): a ReAct agent built with
``init_chat_model`` inside ``wrap_rollout``, a tool to call, rewarded on its final answer."""

from langchain_core.tools import tool
from langgraph.prebuilt import create_react_agent

import tracerl as art
from tracerl.langgraph import init_chat_model, wrap_rollout


@tool
def add(a: int, b: int) -> int:
    """Add two integers"""
    return a + b


async def rollout(model: art.TrainableModel, pair: tuple[int, int], attempt: int
                  ) -> art.Trajectory:
    trajectory = art.Trajectory(messages_and_choices=[], reward=0.0,
                                metadata={"pair": list(pair)})
    agent = create_react_agent(init_chat_model(model.name, temperature=1.0, max_tokens=40),
                               [add])
    state = await agent.ainvoke({"messages": [
        {"role": "system", "content": "Use the add tool, then answer with the result."},
        {"role": "user", "content": f"What is {pair[0]} + {pair[1]}?"}]})
    # the right sum, and (tiny groups must not tie) the first attempt preferred by half a
    # point: 0.5 or 1.5 against 0 or 1 (a whole point tied a wrong first attempt with a right
    # second one, and the step had nothing to train)
    trajectory.reward = float(str(sum(pair)) in (state["messages"][-1].content or "")) + (
        0.5 * (attempt == 0))
    return trajectory


async def main(backend, base_model="smollm2"):
    model = art.TrainableModel(
        name="langgraph", project="art-docs", base_model=base_model,
        _internal_config=art.dev.InternalModelConfig(
            engine_args={"tool_call_parser": "hermes"}, chat_template_path="chatml-tools"))
    await model.register(backend)
    groups = await art.gather_trajectory_groups(
        (art.TrajectoryGroup(wrap_rollout(model, rollout)(model, pair, i) for i in range(2))
         for pair in [(3, 4)]),
        max_exceptions=2)
    result = await backend.train(model, groups, learning_rate=1e-5)
    await model.log(groups, metrics=result.metrics, step=result.step, split="train")
    return model, groups, result
