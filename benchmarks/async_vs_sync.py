"""Training steps per minute: the async pipeline (``RolloutPipeline``, bounded off-policy) versus
the synchronous loop (gather a step's groups, train, repeat), on the same rollout workload.

Each rollout is an agent turn of varied length: one sampled chat call through the gateway
(``max_tokens`` drawn from ``--lengths``) followed by an environment wait drawn from
``--env-s`` (a tool or a judge: time the rollout spends outside the model). Both sides run the
same scenarios in the same order on the same backend (two models of one base, trained in turn);
the rewards are random, as only time is measured.

    PYTHONPATH=. .venv/bin/python benchmarks/async_vs_sync.py --steps 4 --groups 2 --group-size 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time

import tracerl


def workload(seed: int, n: int, lengths: list[int], env_s: list[float]
             ) -> list[tuple[int, float]]:
    rng = random.Random(seed)
    return [(rng.choice(lengths), rng.choice(env_s)) for _ in range(n)]


def rollout_fn(group_size: int):
    async def one(model, max_tokens: int, env_s: float, seed: int) -> tracerl.Trajectory:
        messages = [{"role": "user", "content": "Tell me about the sea."}]
        r = await model.openai_client().chat.completions.create(
            model=model.name, messages=messages, max_tokens=max_tokens, temperature=1.0)
        await asyncio.sleep(env_s)  # the environment's share of the rollout
        return tracerl.Trajectory(reward=random.Random(seed).random(),
                                  messages_and_choices=[*messages, r.choices[0]])

    async def rollout(model, scenario: tuple[int, tuple[int, float]], config
                      ) -> tracerl.TrajectoryGroup:
        index, (max_tokens, env_s) = scenario
        return await tracerl.TrajectoryGroup(
            [one(model, max_tokens, env_s, index * 100 + i) for i in range(group_size)])

    return rollout


async def run_sync(model, rollout, scenarios, groups: int, steps: int,
                   config: tracerl.TrainConfig) -> float:
    started = time.perf_counter()
    for step in range(steps):
        batch = scenarios[step * groups:(step + 1) * groups]
        trained = await asyncio.gather(*(rollout(model, s, None) for s in batch))
        await model.train(trained, config)
    return time.perf_counter() - started


async def run_async(model, rollout, scenarios, groups: int, steps: int, bound: int,
                    config: tracerl.TrainConfig) -> float:
    started = time.perf_counter()
    pipeline = tracerl.RolloutPipeline(model, rollout, scenarios, groups_per_step=groups,
                                       max_steps_off_policy=bound, train_config=config)
    async for _ in pipeline.steps(max_steps=steps):
        pass
    return time.perf_counter() - started


async def measure(args: argparse.Namespace) -> dict:
    backend = tracerl.LocalBackend(path=tempfile.mkdtemp(prefix="tracerl-async-bench-"),
                                   engine=args.engine)
    config = tracerl.TrainConfig(learning_rate=1e-5)
    engine = tracerl.EngineConfig(max_model_len=512, resident_adapters=args.bound + 1)
    total = args.steps * args.groups * (args.bound + 2)  # the pipeline may run ahead
    scenarios = list(enumerate(workload(0, total, args.lengths, args.env_s)))
    rollout = rollout_fn(args.group_size)
    results: dict[str, list[float]] = {"sync": [], "async": []}
    try:
        for repeat in range(args.repeats):
            for kind in ("sync", "async") if repeat % 2 == 0 else ("async", "sync"):
                model = tracerl.TrainableModel(
                    name=f"{kind}{repeat}", project="bench", base_model=args.base_model,
                    config=tracerl.ModelConfig(engine=engine))
                await model.register(backend)
                if kind == "sync":
                    seconds = await run_sync(model, rollout, scenarios, args.groups, args.steps,
                                             config)
                else:
                    seconds = await run_async(model, rollout, scenarios, args.groups,
                                              args.steps, args.bound, config)
                results[kind].append(args.steps * 60 / seconds)
    finally:
        await backend.close()
    best = {k: max(v) for k, v in results.items()}
    return {"steps_per_min": results, "best": best, "ratio": best["async"] / best["sync"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--groups", type=int, default=2, help="groups per step")
    ap.add_argument("--group-size", type=int, default=2)
    ap.add_argument("--bound", type=int, default=1, help="max_steps_off_policy of the pipeline")
    ap.add_argument("--lengths", type=int, nargs="+", default=[4, 16, 48])
    ap.add_argument("--env-s", type=float, nargs="+", default=[0.0, 1.0, 3.0])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--engine", default="transformers")
    ap.add_argument("--base-model", default="smollm2")
    args = ap.parse_args()
    print(json.dumps(asyncio.run(measure(args)), indent=1))


if __name__ == "__main__":
    main()
