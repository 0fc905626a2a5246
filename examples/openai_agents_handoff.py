"""Train the model behind an OpenAI Agents SDK triage agent that hands off to a math agent
with a function tool (CPU, a few steps). The agents are plain SDK code; tracerl provides the
model provider (no trace upload: tracerl's processor replaces the SDK's exporter).

    .venv/bin/python examples/openai_agents_handoff.py --steps 2
"""

from __future__ import annotations

import asyncio

from agents import Agent, ModelSettings, RunConfig, Runner, function_tool
from agents.exceptions import MaxTurnsExceeded, ModelBehaviorError
from calculator_task import (
    SYSTEM,
    answer_reward,
    as_response_items,
    handoff_examples,
    question,
    tool_model,
)
from common import parse_args, train_loop

import tracerl
from tracerl.integrations.openai_agents import TracerlModelProvider


@function_tool
def add(a: int, b: int) -> int:
    """Add two integers"""
    return a + b


SETTINGS = ModelSettings(temperature=0.7, max_tokens=60)
math_agent = Agent(name="math_agent", instructions=SYSTEM, tools=[add], model_settings=SETTINGS)
triage = Agent(name="triage", instructions="Hand math questions to the math agent.",
               handoffs=[math_agent], model_settings=SETTINGS)


async def main() -> None:
    args = parse_args(__doc__)
    backend = tracerl.LocalBackend(path=args.path, engine="transformers")
    model = tool_model("agents-calc")
    await model.register(backend)
    run_config = RunConfig(model_provider=TracerlModelProvider(model), workflow_name="calc")

    async def rollout(a: int, b: int) -> tracerl.Trajectory:
        try:
            result = await Runner.run(
                triage, as_response_items([*handoff_examples("math_agent"), question(a, b)]),
                run_config=run_config, max_turns=6)
        except (ModelBehaviorError, MaxTurnsExceeded) as e:
            # the model called a tool that does not exist or looped: a bad rollout to learn
            # from (its calls are recorded), not an infrastructure failure
            return tracerl.Trajectory(reward=-0.5, metadata={"error": type(e).__name__})
        return tracerl.Trajectory(reward=answer_reward(result.final_output, a + b),
                                  metadata={"last_agent": result.last_agent.name})

    await train_loop(model, rollout, args)
    await backend.close()


if __name__ == "__main__":
    asyncio.run(main())
