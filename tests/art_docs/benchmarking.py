"""ART's benchmarking page (docs: tutorials/benchmarking-models): comparison models run the
same validation rollouts and log them; ``art.utils.benchmarking`` loads them side by side."""

import tracerl as art
from tracerl.utils.benchmarking import load_trajectories


async def rollout(model: art.Model, n: int) -> art.Trajectory:
    messages: art.Messages = [{"role": "user", "content": f"What is {n} + {n}?"}]
    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), messages=messages, max_tokens=8)
    content = completion.choices[0].message.content or ""
    return art.Trajectory(messages_and_choices=[*messages, completion.choices[0]],
                          reward=float(str(2 * n) in content))


async def main(backend, trained: art.TrainableModel, base_model_name: str):
    models = [trained, art.Model(name="benchmark-base", project=trained.project,
                                 inference_model_name=base_model_name,
                                 inference_base_url=trained.inference_base_url,
                                 inference_api_key=trained.inference_api_key)]
    for model in models:
        if model is not trained:
            await model.register(backend)
        groups = await art.gather_trajectory_groups(
            [art.TrajectoryGroup(rollout(model, n) for _ in range(2)) for n in (1, 2)])
        await model.log(groups, split="val")
    return await load_trajectories(trained.project, [m.name for m in models],
                                   art_path=backend.path)
