"""ART's client page (docs: fundamentals/art-client): a trainable model configured through
``_internal_config`` after construction, and a non-trainable comparison model that logs its
own trajectories; the backend used as a context manager."""

import tracerl as art


async def rollout(model: art.Model, question: str, attempt: int) -> art.Trajectory:
    messages: art.Messages = [{"role": "user", "content": question}]
    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), messages=messages, max_tokens=8)
    return art.Trajectory(messages_and_choices=[*messages, completion.choices[0]],
                          reward=float(attempt == 0))  # tiny groups must not tie


async def main(backend, base_model="smollm2", base_model_name="SmolLM2-135M-Instruct"):
    model = art.TrainableModel(name="client", project="art-docs", base_model=base_model)
    model._internal_config = art.dev.InternalModelConfig(
        init_args=art.dev.InitArgs(max_seq_length=512),
        engine_args=art.dev.EngineArgs(max_num_seqs=4))
    await model.register(backend)

    # a comparison model served elsewhere: here, the base model behind the same gateway
    comparison = art.Model(name="base-comparison", project="art-docs",
                           inference_model_name=base_model_name,
                           inference_base_url=model.inference_base_url,
                           inference_api_key=model.inference_api_key)
    await comparison.register(backend)

    groups = await art.gather_trajectory_groups(
        [art.TrajectoryGroup(rollout(model, "Name a fruit.", i) for i in range(2))])
    result = await backend.train(model, groups, learning_rate=1e-4, loss_fn="ppo")
    await model.log(groups, metrics=result.metrics, step=result.step, split="train")

    val = await art.gather_trajectory_groups(
        [art.TrajectoryGroup(rollout(comparison, "Name a fruit.", i) for i in range(2))])
    await comparison.log(val, split="val")
    return model, comparison, result
