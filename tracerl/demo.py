"""``tracerl demo``: GRPO on SmolLM2-135M-Instruct, on CPU, through the real gateway.

The task is verifiable: "Repeat this number: 4721" must be answered with the number alone. The
reward is 0 when the number is missing, and otherwise 1 minus 0.1 per extra word (at least 0.2),
so brevity and exactness are both learnt. Held-out numbers are evaluated greedily before, during
and after training.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import sys
import time

import tracerl

SYSTEM = "Reply with the number only."


def number_reward(text: str, number: str) -> float:
    """1.0 for exactly the number; less per extra word; 0 if the number is absent."""
    words = re.findall(r"\S+", text)
    if number not in re.findall(r"\d+", text):
        return 0.0
    extra = max(len(words) - 1, 0)
    return max(1.0 - 0.1 * extra, 0.2)


def scenarios(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    return [str(rng.randint(100, 9999)) for _ in range(n)]


async def rollout(model: tracerl.Model, number: str, temperature: float) -> tracerl.Trajectory:
    client = model.openai_client()
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Repeat this number: {number}"}]
    response = await client.chat.completions.create(
        model=model.get_inference_name(), messages=messages, max_tokens=16, temperature=temperature)
    choice = response.choices[0]
    reward = number_reward(choice.message.content or "", number)
    return tracerl.Trajectory(messages_and_choices=[*messages, choice], reward=reward,
                              metrics={"exact": float(reward == 1.0)}, metadata={"number": number})


async def evaluate(model: tracerl.TrainableModel, numbers: list[str]) -> dict[str, float]:
    groups = await tracerl.gather_trajectory_groups(
        [tracerl.TrajectoryGroup(rollout(model, n, 0.0) for n in numbers)],
        pbar_desc="eval", show_progress=False)
    return await model.log(groups, split="val")


def _bar(value: float, width: int = 30) -> str:
    filled = round(max(0.0, min(1.0, value)) * width)
    return "#" * filled + "." * (width - filled)


async def demo(steps: int, engine: str, base_path: str, group_size: int, groups_per_step: int,
               learning_rate: float = 2e-3,
               trainer: tracerl.DistributedTrainerConfig | None = None) -> dict[str, object]:
    """Train and evaluate; returns the held-out evaluations and the train reward curve.
    ``trainer``: train on torch.distributed ranks (``tracerl demo --launcher ray ...``)."""
    os.environ.setdefault("TRACERL_QUIET", "1")
    import torch

    torch.manual_seed(0)  # sampling order still depends on batching, so runs vary a little
    backend = tracerl.LocalBackend(path=base_path, engine=None if engine == "auto" else engine,
                                   trainer=trainer)
    name = f"demo-{int(time.time())}"
    model = tracerl.TrainableModel(
        name=name, project="tracerl-demo", base_model="smollm2",
        config=tracerl.ModelConfig(lora=tracerl.LoraConfig(r=8, alpha=16),
                                   engine=tracerl.EngineConfig(max_model_len=512)))
    print(f"tracerl demo: preparing SmolLM2-135M-Instruct ({engine} engine) ...", file=sys.stderr)
    started = time.perf_counter()
    try:
        await model.register(backend)
        held_out = scenarios(seed=12345, n=24)
        evals = [(0, await evaluate(model, held_out))]
        print(f"step 0 held-out reward {evals[0][1]['reward']:.3f}", file=sys.stderr)
        curve = []
        config = tracerl.TrainConfig(learning_rate=learning_rate, seed=0)
        for step in range(1, steps + 1):
            train_numbers = scenarios(seed=step, n=groups_per_step)
            groups = await tracerl.gather_trajectory_groups(
                (tracerl.TrajectoryGroup(rollout(model, n, 1.0) for _ in range(group_size))
                 for n in train_numbers), pbar_desc=f"step {step}", show_progress=False)
            rewards = [t.reward for g in groups for t in g]
            mean = sum(rewards) / len(rewards)
            metrics = await model.train(groups, config=config)
            curve.append(mean)
            print(
                f"step {step:2d} train reward {mean:.3f} {_bar(mean)} "
                f"loss {metrics.get('loss', 0):+.4f} "
                f"({time.perf_counter() - started:.0f} s)",
                file=sys.stderr,
            )
            if step % 4 == 0 or step == steps:
                evals.append((step, await evaluate(model, held_out)))
                print(f"        held-out reward {evals[-1][1]['reward']:.3f}", file=sys.stderr)
    finally:
        await backend.close()
    print("\nheld-out evaluation (greedy, 24 unseen numbers):")
    for step, m in evals:
        print(
            f"  step {step:2d}  reward {m['reward']:.3f}  exact {m['metrics/exact']:.3f}  "
            f"{_bar(m['reward'])}"
        )
    first, last = evals[0][1]["reward"], evals[-1][1]["reward"]
    print(f"held-out reward {first:.3f} -> {last:.3f} in {time.perf_counter() - started:.0f} s; "
          f"model folder {backend.store(model).root}")
    return {"evals": [(step, m["reward"]) for step, m in evals], "train_curve": curve,
            "model_dir": str(backend.store(model).root)}


def run_demo(steps: int | None = None, engine: str = "auto", base_path: str = ".tracerl",
             group_size: int | None = None, groups_per_step: int | None = None,
             trainer: tracerl.DistributedTrainerConfig | None = None) -> int:
    if engine == "auto":
        import torch

        engine = "auto" if torch.cuda.is_available() else "transformers"  # faster on a small CPU
    asyncio.run(demo(steps or 12, engine, base_path, group_size or 6, groups_per_step or 4,
                     trainer=trainer))
    return 0
