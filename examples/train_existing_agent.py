"""Train the model inside an existing async agent function, ART-style.

The agent below is ordinary OpenAI-client code; the only tracerl parts are the client it gets
(`model.openai_client()`), the Trajectory it returns and the training loop around it.

    .venv/bin/python examples/train_existing_agent.py --steps 3
"""

from __future__ import annotations

import argparse
import asyncio
import random

import tracerl


async def agent(client, model_name: str, city: str) -> str:
    """An existing agent: one LLM call, unchanged except for where its client comes from."""
    response = await client.chat.completions.create(
        model=model_name, max_tokens=24, temperature=1.0,
        messages=[{"role": "system", "content": "Answer in one short sentence."},
                  {"role": "user", "content": f"Which country is {city} in?"}])
    return response.choices[0].message.content or ""


COUNTRIES = {"Paris": "France", "Berlin": "Germany", "Madrid": "Spain", "Rome": "Italy",
             "Lisbon": "Portugal", "Vienna": "Austria"}


async def rollout(model: tracerl.TrainableModel, city: str) -> tracerl.Trajectory:
    answer = await agent(model.openai_client(), model.get_inference_name(), city)
    correct = COUNTRIES[city].lower() in answer.lower()
    brevity = max(0.0, 1.0 - len(answer.split()) / 24)
    return tracerl.Trajectory(messages_and_choices=[{"role": "assistant", "content": answer}],
                              reward=float(correct) + 0.2 * brevity, metrics={"correct": correct},
                              metadata={"city": city})


async def main(steps: int) -> None:
    backend = tracerl.LocalBackend(path=".tracerl", engine="transformers")
    model = tracerl.TrainableModel(name="geo-agent", project="examples", base_model="smollm2")
    await model.register(backend)
    try:
        for _ in range(steps):
            cities = random.sample(sorted(COUNTRIES), 3)
            groups = await tracerl.gather_trajectory_groups(
                (tracerl.TrajectoryGroup(rollout(model, c) for _ in range(4)) for c in cities),
                max_exceptions=0.1)
            metrics = await model.train(groups, config=tracerl.TrainConfig(learning_rate=5e-4))
            print(f"step {await model.get_step()}: loss {metrics.get('loss', 0):+.4f}, "
                  f"reward {sum(t.reward for g in groups for t in g) / 12:.3f}")
    finally:
        await backend.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    asyncio.run(main(parser.parse_args().steps))
