"""An existing async agent trained by an ART-style script, ported to tracerl by its imports.

The agent below is ordinary OpenAI-client code. The script around it is written as for OpenPipe
ART; porting it changed only the imports (``import art`` -> ``import tracerl as art``,
``art.utils`` -> ``tracerl.utils``, ``art.local`` -> ``tracerl.local``). It resumes: run it
again with more ``--steps`` and it continues with the batches it has not trained yet.

    .venv/bin/python examples/train_existing_agent.py --steps 3
"""

from __future__ import annotations

import asyncio
import math

from common import parse_args

import tracerl as art
from tracerl.local import LocalBackend
from tracerl.utils import iterate_dataset


async def agent(client, model_name: str, city: str) -> str:
    """An existing agent: one LLM call, unchanged except for where its client comes from."""
    response = await client.chat.completions.create(
        model=model_name, max_tokens=24, temperature=1.0,
        messages=[{"role": "system", "content": "Answer in one short sentence."},
                  {"role": "user", "content": f"Which country is {city} in?"}])
    return response.choices[0].message.content or ""


COUNTRIES = {"Paris": "France", "Berlin": "Germany", "Madrid": "Spain", "Rome": "Italy",
             "Lisbon": "Portugal", "Vienna": "Austria"}


async def rollout(model: art.TrainableModel, city: str) -> art.Trajectory:
    answer = await agent(model.openai_client(), model.get_inference_name(), city)
    correct = COUNTRIES[city].lower() in answer.lower()
    brevity = max(0.0, 1.0 - len(answer.split()) / 24)
    return art.Trajectory(messages_and_choices=[{"role": "assistant", "content": answer}],
                          reward=float(correct) + 0.2 * brevity, metrics={"correct": correct},
                          metadata={"city": city})


async def main() -> None:
    args = parse_args(__doc__)
    backend = LocalBackend(path=args.path, engine="transformers")  # on CPU faster than vLLM
    model = art.TrainableModel(name="geo-agent", project="examples", base_model="smollm2")
    await model.register(backend)
    cities = sorted(COUNTRIES)
    try:
        for batch in iterate_dataset(cities, groups_per_step=args.groups,
                                     num_epochs=math.ceil(args.steps * args.groups / len(cities)),
                                     initial_step=await model.get_step()):
            if batch.step >= args.steps:
                break
            groups = await art.gather_trajectory_groups(
                (art.TrajectoryGroup(rollout(model, city) for _ in range(args.group_size))
                 for city in batch.items),
                pbar_desc=f"step {batch.step + 1}", max_exceptions=0.1)
            metrics = await model.train(groups, config=art.TrainConfig(learning_rate=5e-4))
            rewards = [t.reward for g in groups for t in g]
            print(f"step {batch.step + 1}: reward {sum(rewards) / max(len(rewards), 1):.3f} "
                  f"loss {metrics.get('loss', 0.0):.4f} "
                  f"trained tokens {metrics.get('trained_tokens', 0):.0f}")
            await model.delete_checkpoints()  # the newest and the best by val/reward stay
    finally:
        await backend.close()


if __name__ == "__main__":
    asyncio.run(main())
