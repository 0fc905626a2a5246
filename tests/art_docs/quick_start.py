"""ART's quick start (docs: getting-started/quick-start), shrunk: rollouts through the model's
OpenAI client, groups gathered, ``backend.train`` then ``model.log`` (ART 0.5's loop)."""

import tracerl as art
from tracerl.utils import iterate_dataset

SCENARIOS = ["red", "green", "blue", "yellow"]


async def rollout(model: art.TrainableModel, color: str, attempt: int) -> art.Trajectory:
    client = model.openai_client()
    messages: art.Messages = [{"role": "user", "content": f"Say the word {color}."}]
    completion = await client.chat.completions.create(
        model=model.get_inference_name(), messages=messages, max_tokens=8)
    choice = completion.choices[0]
    trajectory = art.Trajectory(messages_and_choices=[*messages, choice], reward=0.0)
    # the word said, and (tiny groups must not tie) the first attempt preferred
    said = float(color in (choice.message.content or "").lower())
    trajectory.reward = said + 0.5 * (attempt == 0)
    trajectory.metrics["length"] = len(choice.message.content or "")
    return trajectory


async def main(backend, base_model="smollm2"):
    model = art.TrainableModel(name="quick-start", project="art-docs", base_model=base_model)
    await model.register(backend)
    results = []
    for batch in iterate_dataset(SCENARIOS, groups_per_step=2, num_epochs=1,
                                 initial_step=await model.get_step(), use_tqdm=False):
        train_groups = await art.gather_trajectory_groups(
            [art.TrajectoryGroup(rollout(model, color, attempt) for attempt in range(2))
             for color in batch.items],
            pbar_desc="gather", max_exceptions=4)
        result = await backend.train(model, train_groups, learning_rate=1e-4)
        await model.log(train_groups, metrics=result.metrics, step=result.step, split="train")
        results.append(result)
        if batch.step == 0:
            break
    return model, results
