"""ART's checkpoint deletion page (docs: features/checkpoint-deletion): validate after each
step, then ``model.delete_checkpoints()`` keeps the newest and the best ``val/reward``."""

import tracerl as art

REWARDS = {1: 1.0, 2: 0.2, 3: 0.5}  # the validation reward each step "scores"


def group(reward_a: float, reward_b: float) -> art.TrajectoryGroup:
    def trajectory(reward: float, text: str) -> art.Trajectory:
        return art.Trajectory(messages_and_choices=[
            {"role": "user", "content": "Say hi."}, {"role": "assistant", "content": text}],
            reward=reward)

    return art.TrajectoryGroup([trajectory(reward_a, "Hi!"), trajectory(reward_b, "No.")])


async def main(backend, base_model="smollm2"):
    model = art.TrainableModel(name="ckpt-deletion", project="art-docs", base_model=base_model)
    await model.register(backend)
    for _ in range(3):
        result = await backend.train(model, [group(1.0, 0.0)], learning_rate=1e-5)
        await model.log([group(REWARDS[result.step], REWARDS[result.step])], split="val",
                        step=result.step)
    await model.delete_checkpoints()
    return model
