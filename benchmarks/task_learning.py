"""Held-out learning curves of a catalog task over several seeds: each seed trains a fresh
LoRA on the task's train split and is evaluated greedily on the held-out split before
training, every ``--eval-every`` steps and at the end. Prints the curve table (held-out
success per seed, the mean and the spread) as Markdown for BENCHMARKS.md, and writes a JSON
summary and a report of the curves with their spread (``tracerl report DIR DIR DIR``).

    PYTHONPATH=. .venv/bin/python benchmarks/task_learning.py --task tool-products \\
        --seeds 0 1 2 --steps 12 --eval-every 4 --eval-n 24

``--off-policy B`` trains through the async pipeline (rollouts up to B steps ahead of the
trainer; ``--staleness admit|drop``) instead of the synchronous loop. ``seconds`` is each
seed's wall time, ``train s`` (``train_seconds``) the part outside held-out evaluations
(off-policy, rollouts overlapping an evaluation count as evaluation).

The seeds run one after another (in parallel with ``--parallel`` on a machine with cores to
spare: each is its own process). ``--engine`` is the engine (transformers on CPU; on a GPU,
transformers or vllm).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import tracerl
from tracerl.report import write_comparison
from tracerl.tasks import get_task, train_task
from tracerl.tasks.runner import TaskRun


async def one_seed(args: argparse.Namespace, seed: int) -> dict[str, object]:
    task = get_task(args.task)
    backend = tracerl.LocalBackend(path=args.path, engine=args.engine)
    model = tracerl.TrainableModel(name=f"{args.task}-{args.tag}-seed{seed}",
                                   project="task-learning", base_model=args.base_model,
                                   config=task.model_config())
    if args.dtype != "auto":  # sampling and training in one precision
        model.config.engine.dtype = args.dtype
        os.environ["TRACERL_TRAIN_DTYPE"] = args.dtype
    if args.off_policy is not None:  # rollouts run while the trainer trains
        model.config.engine.sleep_during_training = False
        model.config.engine.resident_adapters = args.off_policy + 1
    try:
        await model.register(backend)
        config = tracerl.TrainConfig(learning_rate=args.lr or task.learning_rate,
                                     loss_fn=args.loss_fn, beta=args.beta, seed=seed,
                                     epsilon_high=args.epsilon_high, credit=args.credit,
                                     warmup_steps=args.warmup_steps)
        dynamic = (tracerl.DynamicSampling(max_draw_factor=args.dynamic_sampling)
                   if args.dynamic_sampling else None)
        run = TaskRun()
        # trained to each evaluation in turn (train_task goes on from the model's step), the
        # seed's results so far written after each: a run cut short keeps its finished points.
        # Off-policy, one call: each call's pipeline would stop the rollouts running ahead.
        ends = (range(args.eval_every, args.steps + args.eval_every, args.eval_every)
                if args.off_policy is None else [args.steps])
        for upto in ends:
            part = await train_task(task, model, steps=min(upto, args.steps), seed=seed,
                                    eval_every=args.eval_every, eval_n=args.eval_n,
                                    group_size=args.group_size, items_per_step=args.items,
                                    config=config, dynamic_sampling=dynamic,
                                    off_policy=args.off_policy, staleness=args.staleness)
            run.evals.update(part.evals)
            run.train_success += part.train_success
            run.sampling += part.sampling
            run.pipeline += part.pipeline
            run.seconds += part.seconds
            run.eval_seconds += part.eval_seconds
            Path(f"{args.out}.seed{seed}.json").write_text(json.dumps(summarise(run, seed)))
    finally:
        await backend.close()
    return {**summarise(run, seed), "model_dir": str(backend.store(model).root)}


def summarise(run: TaskRun, seed: int) -> dict[str, object]:
    return {"seed": seed,
            "held_out": {str(s): round(run.success(s), 4) for s in sorted(run.evals)},
            "train_success": [round(x, 4) for x in run.train_success],
            "sampling": run.sampling, "pipeline": run.pipeline,
            "seconds": round(run.seconds, 1), "train_seconds": round(run.train_seconds, 1),
            "eval_seconds": round(run.eval_seconds, 1)}


def markdown(task: str, results: list[dict]) -> str:
    steps = sorted({int(s) for r in results for s in r["held_out"]})
    head = "| seed | " + " | ".join("base" if s == 0 else f"step {s}" for s in steps) + \
        " | seconds | train s |"
    rows = [head, "|" + "---|" * (len(steps) + 3)]
    for r in results:
        rows.append(f"| {r['seed']} | " + " | ".join(
            f"{r['held_out'].get(str(s), float('nan')):.2f}" for s in steps)
            + f" | {r['seconds']:.0f} | {r['train_seconds']:.0f} |")
    cells = []
    for s in steps:
        vals = [r["held_out"][str(s)] for r in results if str(s) in r["held_out"]]
        cells.append(f"{sum(vals) / len(vals):.2f} ({min(vals):.2f}-{max(vals):.2f})")
    rows.append("| mean (min-max) | " + " | ".join(cells) + " | | |")
    return f"held-out success, {task}:\n\n" + "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", default="tool-products")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--eval-every", type=int, default=4)
    ap.add_argument("--eval-n", type=int, default=24)
    ap.add_argument("--group-size", type=int, default=None)
    ap.add_argument("--items", type=int, default=None, help="items per step")
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--loss-fn", default="ppo", choices=["ppo", "cispo"])
    ap.add_argument("--beta", type=float, default=0.0, help="KL penalty")
    ap.add_argument("--epsilon-high", type=float, default=None, help="clip-higher (DAPO: 0.28)")
    ap.add_argument("--warmup-steps", type=int, default=0)
    ap.add_argument("--credit", default="rollout", choices=["rollout", "turn"])
    ap.add_argument("--dynamic-sampling", type=float, default=0.0, metavar="FACTOR",
                    help="DAPO's dynamic sampling with this max_draw_factor (0: off)")
    ap.add_argument("--off-policy", type=int, default=None, metavar="B",
                    help="async: train through RolloutPipeline with max_steps_off_policy=B "
                         "(default: the synchronous loop)")
    ap.add_argument("--staleness", default="admit", choices=["admit", "drop"],
                    help="the pipeline's staleness policy (with --off-policy)")
    ap.add_argument("--engine", default="transformers")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="the engine's and the trainer's dtype (auto: bf16 on CUDA, fp32 on CPU)")
    ap.add_argument("--base-model", default="smollm2")
    ap.add_argument("--path", default=None, help="backend folder (default: a new temp folder)")
    ap.add_argument("--tag", default=time.strftime("%H%M%S"))
    ap.add_argument("--parallel", action="store_true", help="one process per seed at once")
    ap.add_argument("--out", default="task-learning.json")
    ap.add_argument("--one-seed", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.off_policy is not None and args.off_policy < 0:
        ap.error(f"argument --off-policy: must be >= 0, got {args.off_policy}")
    if args.path is None:
        import tempfile

        args.path = tempfile.mkdtemp(prefix="task-learning-")
    if args.one_seed is not None:
        print(json.dumps(asyncio.run(one_seed(args, args.one_seed))))
        return
    if args.parallel:
        argv = [a for a in sys.argv[1:] if a != "--parallel"]
        procs = [subprocess.Popen([sys.executable, __file__, *argv, "--path", args.path,
                                   "--tag", args.tag, "--one-seed", str(seed)],
                                  stdout=subprocess.PIPE, text=True) for seed in args.seeds]
        results: list[dict[str, object]] = []
        failed: list[int] = []
        for seed, proc in zip(args.seeds, procs, strict=True):
            lines = proc.communicate()[0].strip().splitlines()
            if proc.returncode or not lines:  # the others are still summarised
                failed.append(seed)
                print(f"seed {seed} failed (exit {proc.returncode}); its held-out points so far "
                      f"are in {args.out}.seed{seed}.json", file=sys.stderr)
            else:
                results.append(json.loads(lines[-1]))
        if not results:
            sys.exit(f"every seed failed: {failed}")
    else:
        results, failed = [asyncio.run(one_seed(args, seed)) for seed in args.seeds], []
    summary = {"task": args.task, "args": {k: v for k, v in vars(args).items()
                                           if k != "one_seed"}, "runs": results,
               "failed_seeds": failed}
    Path(args.out).write_text(json.dumps(summary, indent=1))
    report = write_comparison([r["model_dir"] for r in results],
                              out=Path(args.out).with_suffix(".html"))
    print(markdown(args.task, results))
    print(f"\nsummary: {args.out}   curves: {report}")
    if failed:
        sys.exit(f"seeds {failed} failed (see above)")


if __name__ == "__main__":
    main()
