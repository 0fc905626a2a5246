"""Many adapters on one base in the trainer (issue 32), on CPU: memory and step time for
N = 1, 2, 4, 8 trained models of one base model and LoRA shape.

Each N runs in fresh processes (a random-initialised ``tiny-llama`` of
``benchmarks/random_models.py``: 6 layers, hidden 256, SmolLM2's 49k vocabulary; LoRA r=8 on
all linear projections; ROWS rows of TOKENS tokens per model, half of them trained):
  - memory: the trainer process's RSS with N ``SharedBase`` adapters (one base) against N
    ``Trainer`` policies (a base each, what tracerl did before), after one step of each
  - step time, median of --steps after a warm-up, of
      together: one ``optimize_together`` step of the N adapters (rows of different adapters
                mixed in micro-batches, routed per row)
      per-adapter: the same, each micro-batch holding one adapter's rows
      separate: N single-model steps (``AdapterPolicy.optimize``) one after another
    and of one adapter's single step (the ``N=1`` peer of the 1.6x goal)

    PYTHONPATH=$PWD .venv/bin/python benchmarks/many_adapters.py --steps 3 --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tracerl.backend.training.rows import Row
from tracerl.core.config import LoraConfig, TrainConfig

LORA = LoraConfig(r=8, alpha=16)


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def rows(n: int, tokens: int, seed: int) -> list[Row]:
    g = torch.Generator().manual_seed(seed)
    half = tokens // 2
    return [Row(torch.randint(10, 30000, (tokens,), generator=g).tolist(),
                [False] * half + [True] * (tokens - half),
                [float("nan")] * half + [-1.0] * (tokens - half), [1.0] * tokens,
                advantage=1.0 if i % 2 else -1.0) for i in range(n)]


def timed(fns: dict[str, Callable[[], object]], steps: int) -> dict[str, float]:
    """Median seconds of each of ``fns``, run in turn ``steps`` times after a warm-up each
    (interleaved, so that a shared machine's load drifts over all of them alike)."""
    for fn in fns.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(steps):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t)
    return {name: statistics.median(v) for name, v in samples.items()}


def child(args: argparse.Namespace) -> dict[str, float]:
    """One measurement in this (fresh) process."""
    from tracerl.backend.training.adapters import SharedBase, optimize_together
    from tracerl.backend.training.trainer import Trainer

    torch.set_num_threads(args.threads)
    config = TrainConfig(learning_rate=1e-4, micro_batch_tokens=args.micro)
    data = [rows(args.rows, args.tokens, seed) for seed in range(args.n)]
    path = Path(args.model)
    if args.child == "separate":
        trainers = [Trainer(path, LORA, device="cpu") for _ in range(args.n)]
        for t, own in zip(trainers, data, strict=True):
            t.optimize(own, config)
        return {"rss_mib": rss_mib()}
    shared = SharedBase(path, LORA, device="cpu")
    policies = [shared.attach(None) for _ in range(args.n)]
    optimize_together(policies, data, config, mixed=True)
    out = {"rss_mib": rss_mib()}
    if args.child == "time":
        pairs = list(zip(policies, data, strict=True))
        out.update(timed({
            "together_s": lambda: optimize_together(policies, data, config, mixed=True),
            "per_adapter_s": lambda: optimize_together(policies, data, config, mixed=False),
            "separate_s": lambda: [p.optimize(own, config) for p, own in pairs],
            "one_adapter_s": lambda: policies[0].optimize(data[0], config),
        }, args.steps))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ns", default="1,2,4,8")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--micro", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3)
    # 1: on 2 cores shared with other work, 2 torch threads spin-wait on each other (a step
    # measured 25x slower than with 1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--child", choices=["time", "separate"])
    parser.add_argument("--n", type=int)
    parser.add_argument("--model")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    sys.path.insert(0, str(Path(__file__).parent))
    from random_models import random_model_dir

    from tracerl.backend.weights import resolve_base_model

    model = random_model_dir("tiny-llama", resolve_base_model("smollm2"))
    results = []
    for n in (int(x) for x in args.ns.split(",")):
        row: dict[str, float] = {"n": n}
        for kind in ("time", "separate"):
            cmd = [sys.executable, __file__, "--child", kind, "--n", str(n), "--model",
                   str(model)] + [f"--{k}={getattr(args, k)}" for k in
                                  ("rows", "tokens", "micro", "steps", "threads")]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True,
                                 env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
            got = json.loads(out.stdout.strip().splitlines()[-1])
            row.update({f"{kind}_{k}" if k == "rss_mib" else k: v for k, v in got.items()})
        results.append(row)
        print(json.dumps(row), flush=True)
    one = next((r["one_adapter_s"] for r in results if r["n"] == 1), results[0]["one_adapter_s"])
    print("| N | RSS one base (MiB) | RSS a base each (MiB) | together (s) | per-adapter "
          "micro-batches (s) | N separate steps (s) | together / separate | together / one "
          "adapter's step |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['n']} | {r['time_rss_mib']:.0f} | {r['separate_rss_mib']:.0f} | "
              f"{r['together_s']:.2f} | {r['per_adapter_s']:.2f} | {r['separate_s']:.2f} | "
              f"{r['together_s'] / r['separate_s']:.2f} | {r['together_s'] / one:.2f} |")


if __name__ == "__main__":
    main()
