"""``tracerl demo``: GRPO on SmolLM2-135M-Instruct, on CPU, through the real gateway.

The task is verifiable: "Repeat this number: 4721" must be answered with the number alone. The
reward is 0 when the number is missing, and otherwise 1 minus 0.1 per extra word (at least 0.2),
so brevity and exactness are both learnt. Held-out numbers are evaluated greedily before, during
and after training.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import random
import re
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

from openai.types.chat import ChatCompletionMessageParam
from tqdm.auto import tqdm

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
    messages: list[ChatCompletionMessageParam] = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Repeat this number: {number}"}]
    response = await client.chat.completions.create(
        model=model.get_inference_name(), messages=messages, max_tokens=16, temperature=temperature)
    choice = response.choices[0]
    reward = number_reward(choice.message.content or "", number)
    return tracerl.Trajectory(messages_and_choices=[*messages, choice], reward=reward,
                              metrics={"exact": float(reward == 1.0)}, metadata={"number": number})


async def evaluate(model: tracerl.TrainableModel, numbers: list[str], desc: str = "held-out"
                   ) -> dict[str, float]:
    groups = await tracerl.gather_trajectory_groups(
        [tracerl.TrajectoryGroup(rollout(model, n, 0.0) for n in numbers)],
        pbar_desc=desc, show_progress=True)
    return await model.log(groups, split="val")


@contextlib.asynccontextmanager
async def phase_bar(desc: str) -> AsyncIterator[None]:
    """A bar for a phase without countable parts (a training step): it shows the time spent."""
    bar = tqdm(total=1, desc=desc, file=sys.stderr, dynamic_ncols=True,
               bar_format="{desc}: {elapsed}")

    async def tick() -> None:
        while True:
            await asyncio.sleep(1)
            bar.refresh()

    ticker = asyncio.ensure_future(tick())
    try:
        yield
        bar.update(1)
    finally:
        ticker.cancel()
        bar.close()


class _AboveBars(logging.StreamHandler):
    """Log lines printed above the progress bars instead of onto them."""

    def emit(self, record: logging.LogRecord) -> None:
        tqdm.write(self.format(record), file=sys.stderr)


def log_above_bars() -> None:
    """Route the CLI's ``tracerl`` log lines (step-health warnings) around the bars."""
    logger = logging.getLogger("tracerl")
    for handler in list(logger.handlers):
        if type(handler) is logging.StreamHandler:
            above = _AboveBars()
            above.setFormatter(handler.formatter)
            above.setLevel(handler.level)
            logger.removeHandler(handler)
            logger.addHandler(above)


def quiet_third_party() -> None:
    """No loading bars from transformers / huggingface_hub (ours show the phases instead)."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def write_plots(model_dir: Path) -> list[str]:
    """The run's report (HTML, always) and its curves as PNG (when matplotlib is installed)."""
    from .core.errors import ConfigError
    from .report import write_png, write_report

    paths = [str(write_report(model_dir))]
    with contextlib.suppress(ConfigError):
        paths.append(str(write_png(model_dir)))
    return paths


def cosine(step: int, steps: int, start: float, end: float | None) -> float:
    """The learning rate of ``step`` (1-based): from ``start`` down to ``end`` along a half
    cosine (constant when ``end`` is None)."""
    if end is None or steps == 1:
        return start
    return end + (start - end) * 0.5 * (1 + math.cos(math.pi * (step - 1) / (steps - 1)))


def _bar(value: float, width: int = 30) -> str:
    filled = round(max(0.0, min(1.0, value)) * width)
    return "#" * filled + "." * (width - filled)


async def demo(steps: int, engine: str, base_path: str, group_size: int, groups_per_step: int,
               learning_rate: float = 2e-3, final_learning_rate: float | None = 5e-4,
               eval_every: int = 4, seed: int = 0,
               trainer: tracerl.DistributedTrainerConfig | None = None) -> dict[str, object]:
    """Train and evaluate; returns the held-out evaluations and the train reward curve.
    The learning rate falls from ``learning_rate`` to ``final_learning_rate`` along a half
    cosine (README: a constant 2e-3 once fell back after solving the task).
    ``trainer``: train on torch.distributed ranks (``tracerl demo --launcher ray ...``)."""
    os.environ.setdefault("TRACERL_QUIET", "1")
    quiet_third_party()
    log_above_bars()
    import torch

    torch.manual_seed(seed)  # sampling order still depends on batching, so runs vary a little
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
        evals = [(0, await evaluate(model, held_out, "held-out before training"))]
        curve = []
        for step in range(1, steps + 1):
            config = tracerl.TrainConfig(
                learning_rate=cosine(step, steps, learning_rate, final_learning_rate), seed=seed)
            train_numbers = scenarios(seed=1000 * seed + step, n=groups_per_step)
            groups = await tracerl.gather_trajectory_groups(
                (tracerl.TrajectoryGroup(rollout(model, n, 1.0) for _ in range(group_size))
                 for n in train_numbers), pbar_desc=f"step {step}/{steps} rollouts")
            rewards = [t.reward for g in groups for t in g]
            mean = sum(rewards) / len(rewards)
            async with phase_bar(f"step {step}/{steps} training"):
                metrics = await model.train(groups, config=config)
            curve.append(mean)
            print(f"step {step:2d} train reward {mean:.3f} {_bar(mean)} "
                  f"loss {metrics.get('loss', 0):+.4f} "
                  f"({time.perf_counter() - started:.0f} s)", file=sys.stderr)
            if step % eval_every == 0 or step == steps:
                evals.append((step, await evaluate(model, held_out, f"held-out after {step}")))
    finally:
        await backend.close()
    elapsed = time.perf_counter() - started
    model_dir = backend.store(model).root
    plots = write_plots(model_dir)
    print("\nheld-out evaluation (greedy, 24 unseen numbers):")
    for step, m in evals:
        print(f"  step {step:2d}  reward {m['reward']:.3f}  exact {m['metrics/exact']:.3f}  "
              f"{_bar(m['reward'])}")
    first, last = evals[0][1]["reward"], evals[-1][1]["reward"]
    print(f"\nheld-out reward {first:.3f} -> {last:.3f} after {steps} steps in {elapsed:.0f} s\n"
          f"model folder: {model_dir}\nreport:       {plots[0]}\n"
          + (f"plot:         {plots[1]}\n" if len(plots) > 1 else "")
          + f"next:         tracerl report --serve {model_dir}   (live trajectory viewer)\n"
          f"              tracerl doctor --run {model_dir}")
    return {"evals": [(step, m["reward"]) for step, m in evals], "train_curve": curve,
            "model_dir": str(model_dir), "seconds": elapsed}


def run_demo(steps: int | None = None, engine: str = "auto", base_path: str = ".tracerl",
             group_size: int | None = None, groups_per_step: int | None = None,
             seed: int = 0, trainer: tracerl.DistributedTrainerConfig | None = None) -> int:
    if engine == "auto":
        import torch

        engine = "auto" if torch.cuda.is_available() else "transformers"  # faster on a small CPU
    asyncio.run(demo(steps or 8, engine, base_path, group_size or 6, groups_per_step or 4,
                     seed=seed, trainer=trainer))
    return 0
