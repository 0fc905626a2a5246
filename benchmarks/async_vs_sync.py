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

``--adapter-steps-only`` times only the ``--steps`` steps that come after the first
``--bound + 1`` steps of each side (which run untimed before them): at bound b the async side's
first b + 1 steps train on groups sampled by policy 0, the base model, which vLLM serves without
LoRA, while the sync side samples through its adapter from step 2 on; after them both sides
sample only through adapters (each side's line says how many of its timed calls the base model
served: ``base_calls_timed``, 0 then). When the async side's ``steps(max_steps=...)`` ends, its
rollouts still in flight are cancelled, in the engine too (``cancelled_groups``), so that the
next side starts on an idle server.

    PYTHONPATH=. .venv/bin/python benchmarks/async_vs_sync.py --steps 4 --groups 2 --group-size 2
    PYTHONPATH=. .venv/bin/python benchmarks/async_vs_sync.py --task numbers --steps 8 \
        --groups 4 --group-size 6 --bound 2 --repeats 2
    PYTHONPATH=. .venv/bin/python benchmarks/async_vs_sync.py --steps 8 --groups 2 \
        --group-size 2 --bound 1 --lengths 4 32 --env-s 0 0 8 --staleness drop admit --skip-sync
    PYTHONPATH=. .venv/bin/python benchmarks/async_vs_sync.py --random-init tiny-llama \
        --steps 1 --groups 1 --group-size 2 --bound 1 --lengths 4 8 --env-s 0 --adapter-steps-only
    # on a GPU (vLLM and the trainer sharing it), a random-initialised 1.5B shape:
    python benchmarks/async_vs_sync.py --engine vllm --random-init qwen2.5-1.5b \
        --gpu-memory-utilization 0.5 --lengths 64 256 1024 --env-s 0 1 --bound 2 \
        --adapter-steps-only
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
    """Each step's train config, the held-out evaluations (their time kept apart), and the
    clock: the first ``untimed`` steps (``--adapter-steps-only``) run before it starts."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.curve, self.eval_s = args, [], 0.0
        self.held_out = demo.scenarios(seed=12345, n=24) if args.task == "numbers" else None
        self.untimed = args.bound + 1 if args.adapter_steps_only else 0
        self.last = self.untimed + args.steps
        self._started, self._eval_s_then = 0.0, 0.0

    def config(self, step: int) -> tracerl.TrainConfig:
        if self.held_out is None:
            return tracerl.TrainConfig(learning_rate=1e-5)
        return tracerl.TrainConfig(learning_rate=demo.cosine(step, self.last, 2e-3, 5e-4))

    def trained(self, step: int) -> None:
        """``step`` steps are done (0: none yet): the clock starts after the untimed ones."""
        if step == self.untimed:
            self._started, self._eval_s_then = time.perf_counter(), self.eval_s

    def seconds(self) -> float:
        """Seconds since the clock started, less the evaluations meanwhile."""
        return time.perf_counter() - self._started - (self.eval_s - self._eval_s_then)

    async def after(self, model, step: int) -> None:
        """Evaluate at step 0, every ``--eval-every`` steps and at the last step."""
        if self.held_out is None or (step % self.args.eval_every and step != self.last):
            return
        started = time.perf_counter()
        result = await demo.evaluate(model, self.held_out, f"held-out after {step}")
        self.curve.append((step, round(result["reward"], 3)))
        self.eval_s += time.perf_counter() - started


def base_calls(groups: list) -> int:
    """Calls among ``groups`` that the base model served (no adapter yet)."""
    return sum(not c.adapter_step for g in groups for t in g.trajectories for c in t.llm_calls)


async def run_sync(model, rollout, scenarios, groups: int, schedule: Schedule
                   ) -> tuple[float, dict]:
    await schedule.after(model, 0)
    schedule.trained(0)
    base = 0
    for step in range(schedule.last):
        batch = scenarios[step * groups:(step + 1) * groups]
        trained = await asyncio.gather(*(rollout(model, s, None) for s in batch))
        if step >= schedule.untimed:
            base += base_calls(trained)
        await model.train(trained, schedule.config(step + 1))
        await schedule.after(model, step + 1)
        schedule.trained(step + 1)
    return schedule.seconds(), {"base_calls_timed": base}


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


async def run_async(model, rollout, scenarios, groups: int, bound: int,
                    schedule: Schedule, staleness: str = "admit") -> tuple[float, dict]:
    await schedule.after(model, 0)
    schedule.trained(0)
    pipeline = tracerl.RolloutPipeline(model, rollout, scenarios, groups_per_step=groups,
                                       max_steps_off_policy=bound,
                                       train_config=schedule.config(1), staleness=staleness)
    trained, seconds = [], 0.0
    # ending (max_steps) cancels the rollouts still in flight, in the engine too
    async for step in pipeline.steps(max_steps=schedule.last):
        trained.append(step)
        pipeline.train_config = schedule.config(len(trained) + 1)
        await schedule.after(model, len(trained))  # the pipeline trains nothing meanwhile
        schedule.trained(len(trained))
        if len(trained) == schedule.last:  # the stop's cancelling left out
            seconds = schedule.seconds()
    timed = trained[schedule.untimed:]
    return seconds, {**kept_and_dropped(timed),
                     "base_calls_timed": base_calls([g for t in timed for g in t.groups]),
                     "cancelled_groups": pipeline.cancelled_groups}


async def measure(args: argparse.Namespace) -> dict:
    backend = tracerl.LocalBackend(path=tempfile.mkdtemp(prefix="tracerl-async-bench-"),
                                   engine=args.engine)
    # both sides serve while the trainer trains (the pipeline needs it; on one GPU vLLM then
    # keeps --gpu-memory-utilization of it and the trainer the rest)
    engine = tracerl.EngineConfig(max_model_len=max(512, max(args.lengths) + 128),
                                  resident_adapters=args.bound + 1, sleep_during_training=False,
                                  gpu_memory_utilization=args.gpu_memory_utilization)
    # the pipeline may run ahead, and drop groups
    total = (args.steps + args.bound + 1) * args.groups * (args.bound + 2) * 2
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
    staleness: dict[str, list[dict]] = {side: [] for side in sides}
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
                    seconds, stats = await run_sync(model, rollout, scenarios, args.groups,
                                                    schedule)
                else:
                    seconds, stats = await run_async(
                        model, rollout, scenarios, args.groups, args.bound, schedule,
                        kind.removeprefix("async-") if "-" in kind else "admit")
                staleness[kind].append(stats)
                results[kind].append(args.steps * 60 / seconds)
                curves[kind].append(schedule.curve)
                # each side as it ends, so a run cut short by its time limit still tells
                print(json.dumps({"side": kind, "repeat": repeat, "seconds": seconds,
                                  "steps_per_min": results[kind][-1],
                                  **staleness[kind][-1]}),
                      file=sys.stderr, flush=True)
    finally:
        await backend.close()
    best = {k: max(v) for k, v in results.items()}
    out: dict = {"steps_per_min": results, "best": best}
    if "sync" in best:
        out["ratio"] = {k: v / best["sync"] for k, v in best.items() if k != "sync"}
    elif {"async-admit", "async-drop"} <= best.keys():
        out["ratio_admit_over_drop"] = best["async-admit"] / best["async-drop"]
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
    ap.add_argument("--adapter-steps-only", action="store_true",
                    help="run the first --bound + 1 steps of each side untimed (they sample "
                    "from the base model on the async side) and time the --steps after them")
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
