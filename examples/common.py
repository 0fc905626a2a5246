"""The training loop the framework examples share: rollouts in groups, one GRPO step each."""

from __future__ import annotations

import argparse
from collections.abc import Awaitable, Callable

from calculator_task import rng_sums

import tracerl


def parse_args(doc: str | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=doc)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--groups", type=int, default=2, help="problems per step")
    ap.add_argument("--group-size", type=int, default=3, help="rollouts per problem")
    ap.add_argument("--path", default=".tracerl", help="where the backend keeps models")
    return ap.parse_args()


async def train_loop(model: tracerl.TrainableModel,
                     rollout: Callable[[int, int], Awaitable[tracerl.Trajectory]],
                     args: argparse.Namespace, learning_rate: float = 5e-5) -> None:
    for step in range(await model.get_step(), args.steps):
        groups = await tracerl.gather_trajectory_groups(
            (tracerl.TrajectoryGroup(rollout(a, b) for _ in range(args.group_size))
             for a, b in rng_sums(args.groups, seed=step)),
            max_exceptions=0.5, pbar_desc=f"step {step + 1}")
        metrics = await model.train(groups, config=tracerl.TrainConfig(learning_rate=learning_rate))
        rewards = [t.reward for g in groups for t in g.trajectories]
        print(f"step {step + 1}: reward {sum(rewards) / max(len(rewards), 1):.3f} "
              f"loss {metrics.get('loss', 0.0):.4f} "
              f"trained tokens {metrics.get('trained_tokens', 0):.0f}")
