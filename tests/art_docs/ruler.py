"""ART's RULER page (docs: fundamentals/ruler): ``ruler_score_group`` as ``after_each`` with
``swallow_exceptions=True``; a judge that fails on every group makes the step a skipped one."""

import tracerl as art
from tracerl.rewards import ruler_score_group


async def rollout(model: art.TrainableModel, topic: str) -> art.Trajectory:
    messages: art.Messages = [{"role": "user", "content": f"One word about {topic}."}]
    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), messages=messages, max_tokens=8)
    return art.Trajectory(messages_and_choices=[*messages, completion.choices[0]], reward=0.0)


async def train_step(backend, model, judge_params):
    groups = await art.gather_trajectory_groups(
        (art.TrajectoryGroup(rollout(model, topic) for _ in range(2)) for topic in ["sea"]),
        after_each=lambda group: ruler_score_group(
            group, "openai/judge", extra_litellm_params=judge_params, swallow_exceptions=True),
        max_exceptions=2)
    result = await backend.train(model, groups, learning_rate=1e-4)
    await model.log(groups or None, metrics=result.metrics, step=result.step, split="train")
    return groups, result


async def main(backend, judge_params, failing_judge_params, base_model="smollm2"):
    model = art.TrainableModel(name="ruler", project="art-docs", base_model=base_model)
    await model.register(backend)
    judged = await train_step(backend, model, judge_params)
    skipped = await train_step(backend, model, failing_judge_params)
    return model, judged, skipped
