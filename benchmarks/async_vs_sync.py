"""Training steps per minute: the async pipeline (``RolloutPipeline``, bounded off-policy) versus
the synchronous loop (gather a step's groups, train, repeat), on the same rollout workload.

Each rollout is an agent turn of varied length: one sampled chat call through the gateway
(``max_tokens`` drawn from ``--lengths``) followed by an environment wait drawn from
``--env-s`` (a tool or a judge: time the rollout spends outside the model). Both sides run the
same scenarios in the same order on the same backend (two models of one base, trained in turn);
the rewards are random, as only time is measured.

``--task numbers`` runs the demo's task instead (``tracerl demo``: repeat a number, real reward,
the demo's learning-rate schedule) and evaluates both sides on the demo's 24 held-out numbers
(greedy) every ``--eval-every`` steps, so that the async side's reward curve is compared with
the sync side's at equal steps; evaluation time is left out of both sides' steps per minute.
(During an evaluation between steps the async side's rollout workers may go on up to their
off-policy bound, which they usually have reached already: a small bias in async's favour,
none with ``--eval-every`` equal to ``--steps``, where only the start and the end are
evaluated.)

``--staleness drop admit`` runs the async side once per staleness policy of the pipeline
(``RolloutPipeline(staleness=...)``: drop groups that went stale, or admit by staleness and keep
them) and reports, per policy, the groups dropped and the mean length (completion tokens per
rollout, seconds per group) of the kept and the dropped ones; ``--skip-sync`` leaves the
synchronous side out (the ratio is then admit over drop). A slow kind among fast ones
(``--env-s 0 0 8``) is the workload where dropping starves the slow rollouts.

    PYTHONPATH=. .venv/bin/python benchmarks/async_vs_sync.py --steps 4 --groups 2 --group-size 2
    PYTHONPATH=. .venv/bin/python benchmarks/async_vs_sync.py --task numbers --steps 8 \
        --groups 4 --group-size 6 --bound 2 --repeats 2
    PYTHONPATH=. .venv/bin/python benchmarks/async_vs_sync.py --steps 8 --groups 2 \
        --group-size 2 --bound 1 --lengths 4 32 --env-s 0 0 8 --staleness drop admit --skip-sync
    # on a GPU (vLLM and the trainer sharing it), a random-initialised 1.5B shape:
    python benchmarks/async_vs_sync.py --engine vllm --random-init qwen2.5-1.5b \
        --gpu-memory-utilization 0.5 --lengths 64 256 1024 --env-s 0 1 --bound 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time

import tracerl
from tracerl import demo


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


def numbers_rollout(group_size: int):
    async def rollout(model, scenario: tuple[int, str], config) -> tracerl.TrajectoryGroup:
        return await tracerl.TrajectoryGroup(
            [demo.rollout(model, scenario[1], 1.0) for _ in range(group_size)])

    return rollout


class Schedule:
    """Each step's train config, and the held-out evaluations (their time kept apart)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.curve, self.eval_s = args, [], 0.0
        self.held_out = demo.scenarios(seed=12345, n=24) if args.task == "numbers" else None

    def config(self, step: int) -> tracerl.TrainConfig:
        if self.held_out is None:
            return tracerl.TrainConfig(learning_rate=1e-5)
        return tracerl.TrainConfig(learning_rate=demo.cosine(step, self.args.steps, 2e-3, 5e-4))

    async def after(self, model, step: int) -> None:
        """Evaluate at step 0, every ``--eval-every`` steps and at the last step."""
        if self.held_out is None or (step % self.args.eval_every and step != self.args.steps):
            return
        started = time.perf_counter()
        result = await demo.evaluate(model, self.held_out, f"held-out after {step}")
        self.curve.append((step, round(result["reward"], 3)))
        self.eval_s += time.perf_counter() - started


async def run_sync(model, rollout, scenarios, groups: int, steps: int,
                   schedule: Schedule) -> float:
    await schedule.after(model, 0)
    started = time.perf_counter()
    for step in range(steps):
        batch = scenarios[step * groups:(step + 1) * groups]
        trained = await asyncio.gather(*(rollout(model, s, None) for s in batch))
        await model.train(trained, schedule.config(step + 1))
        await schedule.after(model, step + 1)
    return time.perf_counter() - started - schedule.eval_s


def kept_and_dropped(trained: list) -> dict[str, float]:
    """Groups dropped, held, and the mean length of kept and dropped groups over the run."""
    out: dict[str, float] = {}
    for kind in ("kept", "dropped"):
        counts = [t.metrics[f"pipeline/{kind}_groups"] for t in trained]
        out[f"{kind}_groups"] = sum(counts)
        for unit in ("tokens", "s"):
            key = f"pipeline/{kind}_rollout_{unit}"
            total = sum(t.metrics.get(key, 0.0) * n for t, n in zip(trained, counts, strict=True))
            out[f"{kind}_rollout_{unit}"] = round(total / sum(counts), 2) if sum(counts) else 0.0
    out["held_groups"] = sum(t.metrics["pipeline/held_groups"] for t in trained)
    out["trainer_wait_s"] = round(sum(t.metrics["pipeline/wait_s"] for t in trained), 1)
    return out


async def run_async(model, rollout, scenarios, groups: int, steps: int, bound: int,
                    schedule: Schedule, staleness: str = "admit") -> tuple[float, dict]:
    await schedule.after(model, 0)
    started = time.perf_counter()
    pipeline = tracerl.RolloutPipeline(model, rollout, scenarios, groups_per_step=groups,
                                       max_steps_off_policy=bound,
                                       train_config=schedule.config(1), staleness=staleness)
    trained = []
    async for step in pipeline.steps(max_steps=steps):
        trained.append(step)
        pipeline.train_config = schedule.config(len(trained) + 1)
        await schedule.after(model, len(trained))  # the pipeline trains nothing meanwhile
    return time.perf_counter() - started - schedule.eval_s, kept_and_dropped(trained)


async def measure(args: argparse.Namespace) -> dict:
    backend = tracerl.LocalBackend(path=tempfile.mkdtemp(prefix="tracerl-async-bench-"),
                                   engine=args.engine)
    # both sides serve while the trainer trains (the pipeline needs it; on one GPU vLLM then
    # keeps --gpu-memory-utilization of it and the trainer the rest)
    engine = tracerl.EngineConfig(max_model_len=max(512, max(args.lengths) + 128),
                                  resident_adapters=args.bound + 1, sleep_during_training=False,
                                  gpu_memory_utilization=args.gpu_memory_utilization)
    # the pipeline may run ahead, and drop groups
    total = args.steps * args.groups * (args.bound + 2) * 2
    if args.task == "numbers":
        scenarios = list(enumerate(demo.scenarios(seed=7, n=total)))
        rollout = numbers_rollout(args.group_size)
    else:
        scenarios = list(enumerate(workload(0, total, args.lengths, args.env_s)))
        rollout = rollout_fn(args.group_size)
    sides = ([] if args.skip_sync else ["sync"]) + (
        ["async"] if args.staleness is None else [f"async-{s}" for s in args.staleness])
    results: dict[str, list[float]] = {side: [] for side in sides}
    curves: dict[str, list[list[tuple[int, float]]]] = {side: [] for side in sides}
    staleness: dict[str, list[dict]] = {side: [] for side in sides if side != "sync"}
    try:
        for repeat in range(args.repeats):
            for kind in sides if repeat % 2 == 0 else sides[::-1]:
                model = tracerl.TrainableModel(
                    name=f"{kind.replace('-', '_')}{repeat}", project="bench",
                    base_model=args.base_model,
                    config=tracerl.ModelConfig(engine=engine))
                await model.register(backend)
                schedule = Schedule(args)
                if kind == "sync":
                    seconds = await run_sync(model, rollout, scenarios, args.groups, args.steps,
                                             schedule)
                else:
                    seconds, stats = await run_async(
                        model, rollout, scenarios, args.groups, args.steps, args.bound, schedule,
                        kind.removeprefix("async-") if "-" in kind else "admit")
                    staleness[kind].append(stats)
                results[kind].append(args.steps * 60 / seconds)
                curves[kind].append(schedule.curve)
                # each side as it ends, so a run cut short by its time limit still tells
                print(json.dumps({"side": kind, "repeat": repeat, "seconds": seconds,
                                  "steps_per_min": results[kind][-1],
                                  **(staleness[kind][-1] if kind != "sync" else {})}),
                      file=sys.stderr, flush=True)
    finally:
        await backend.close()
    best = {k: max(v) for k, v in results.items()}
    out: dict = {"steps_per_min": results, "best": best}
    if "sync" in best:
        out["ratio"] = {k: v / best["sync"] for k, v in best.items() if k != "sync"}
    elif {"async-admit", "async-drop"} <= best.keys():
        out["ratio_admit_over_drop"] = best["async-admit"] / best["async-drop"]
    if staleness:
        out["staleness"] = staleness
    if args.task == "numbers":
        out["held_out_reward_by_step"] = curves
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--groups", type=int, default=2, help="groups per step")
    ap.add_argument("--group-size", type=int, default=2)
    ap.add_argument("--bound", type=int, default=1, help="max_steps_off_policy of the pipeline")
    ap.add_argument("--lengths", type=int, nargs="+", default=[4, 16, 48])
    ap.add_argument("--env-s", type=float, nargs="+", default=[0.0, 1.0, 3.0])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--staleness", nargs="+", choices=["drop", "admit"],
                    help="run the async side once per staleness policy (default: the "
                    "pipeline's default, one async side)")
    ap.add_argument("--skip-sync", action="store_true", help="leave the synchronous side out")
    ap.add_argument("--engine", default="transformers")
    ap.add_argument("--base-model", default="smollm2")
    ap.add_argument("--task", choices=["sea", "numbers"], default="sea",
                    help="'sea': timed turns with random rewards; 'numbers': the demo's task")
    ap.add_argument("--eval-every", type=int, default=4, help="held-out evaluation (numbers)")
    ap.add_argument("--random-init", help="a shape from random_models.SHAPES instead of "
                    "--base-model (throughput only: use the 'sea' task)")
    ap.add_argument("--tokenizer", help="tokenizer folder for --random-init (default: SmolLM2's)")
    ap.add_argument("--gpu-memory-utilization", type=float,
                    help="vLLM's share of the GPU (the trainer shares it)")
    args = ap.parse_args()
    if args.random_init:
        from random_models import served_random_model

        args.base_model = served_random_model(args.random_init, args.tokenizer)
    print(json.dumps(asyncio.run(measure(args)), indent=1))


if __name__ == "__main__":
    main()
