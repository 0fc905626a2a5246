"""Step time of the distributed trainer (2 ranks, gloo on CPU) against the one-process trainer.

Peers, on the same rows (SmolLM2-135M, LoRA r=8 on all linear projections, ROWS rows of
TOKENS tokens, half of them trained, micro-batches of MICRO tokens), each after one warm-up
step, median of --steps steps of ``optimize`` (forward, loss, backward, AdamW):
  - one-process: ``Trainer`` in this process (the default path), OMP threads = --threads
  - ddp-2 / fsdp2-2: ``DistributedPolicy`` with 2 torchrun ranks of --threads/2 threads each
  - ddp-1: ``DistributedPolicy`` with 1 rank (the coordinator's and protocol's overhead)

    .venv/bin/python benchmarks/train_step_distributed.py --steps 3 --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from tracerl.backend.training.distributed import start_distributed_policy
from tracerl.backend.training.rows import Row
from tracerl.backend.training.trainer import Trainer
from tracerl.backend.weights import resolve_base_model
from tracerl.core.config import DistributedTrainerConfig, LoraConfig, TrainConfig


def rows(n: int, tokens: int) -> list[Row]:
    g = torch.Generator().manual_seed(0)
    half = tokens // 2
    return [Row(torch.randint(10, 30000, (tokens,), generator=g).tolist(),
                [False] * half + [True] * (tokens - half),
                [float("nan")] * half + [-1.0] * (tokens - half), [1.0] * tokens,
                advantage=1.0 if i % 2 else -1.0) for i in range(n)]


def median_step(policy, batch: list[Row], config: TrainConfig, steps: int) -> float:
    policy.optimize(batch, config)  # warm-up
    samples = []
    for _ in range(steps):
        t = time.perf_counter()
        policy.optimize(batch, config)
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--micro", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    path, lora = resolve_base_model("smollm2"), LoraConfig(r=8, alpha=16)
    config = TrainConfig(learning_rate=1e-4, micro_batch_tokens=args.micro)
    batch = rows(args.rows, args.tokens)
    results = {}
    torch.set_num_threads(args.threads)
    results["one-process"] = median_step(Trainer(path, lora, device="cpu"), batch, config,
                                         args.steps)
    for name, world, strategy in (("ddp-1", 1, "ddp"), ("ddp-2", 2, "ddp"),
                                  ("fsdp2-2", 2, "fsdp2")):
        os.environ["OMP_NUM_THREADS"] = str(max(1, args.threads // world))
        with tempfile.TemporaryDirectory() as tmp:
            policy = start_distributed_policy(
                DistributedTrainerConfig(world_size=world, strategy=strategy, device="cpu"),
                path, lora, None, None, Path(tmp) / "ranks.log")
            try:
                results[name] = median_step(policy, batch, config, args.steps)
            finally:
                policy.close()
    base = results["one-process"]
    print(json.dumps({"args": vars(args), "step_s": results,
                      "vs_one_process": {k: round(base / v, 3) for k, v in results.items()}},
                     indent=2))


if __name__ == "__main__":
    main()
