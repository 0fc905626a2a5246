"""The whole loop on one GPU with vLLM: rollouts through the gateway, a GRPO step, the LoRA
adapter hot-loaded into vLLM, and vLLM's sleep mode freeing its memory while the step trains.

A random-initialised model (SmolLM2-135M by default; values do not matter here); reward =
shorter answers. With ``--shape qwen2.5-7b`` it checks that vLLM and the trainer's copy of the
weights share one GPU (``--gpu-memory-utilization`` leaves the trainer its room);
``--replicas-per-gpu K`` serves it from K vLLM servers on the GPU, all asleep during the step.
Prints,
per step: rollout and training seconds, the adapter step the next rollouts were served with,
and the GPU memory in use (all processes) while vLLM is awake versus during the training step.

    python benchmarks/gpu/vllm_loop.py --tokenizer TOKDIR [--steps 2] [--shape S]
        [--replicas-per-gpu K] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from random_models import random_model_dir

import tracerl


def used_gib() -> float:
    if not torch.cuda.is_available():  # a CPU run checks the loop, not memory
        return 0.0
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**30


class MemorySampler:
    """Lowest and highest device-wide memory in use while a block runs."""

    def __init__(self) -> None:
        self.low, self.high, self._stop = float("inf"), 0.0, threading.Event()

    def __enter__(self) -> MemorySampler:
        def sample() -> None:
            while not self._stop.is_set():
                used = used_gib()
                self.low, self.high = min(self.low, used), max(self.high, used)
                time.sleep(0.05)
        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


async def rollout(model: tracerl.TrainableModel, i: int) -> tracerl.Trajectory:
    response = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), max_tokens=48, temperature=1.0,
        messages=[{"role": "user", "content": f"Count to {i}."}])
    text = response.choices[0].message.content or ""
    return tracerl.Trajectory(messages_and_choices=[response.choices[0]], reward=-len(text) / 100)


async def main(tokenizer: Path, steps: int, shape: str, vllm_share: float | None,
               replicas_per_gpu: int = 1) -> dict:
    path = random_model_dir(shape, tokenizer, vocab="tokenizer")
    backend = tracerl.LocalBackend(path="/tmp/tracerl-vllm-loop", engine="vllm")
    model = tracerl.TrainableModel(
        name=f"loop-{int(time.time())}", project="gpu", base_model=str(path),  # sleeps on CUDA
        config=tracerl.ModelConfig(engine=tracerl.EngineConfig(
            gpu_memory_utilization=vllm_share, replicas_per_gpu=replicas_per_gpu)))
    started = time.perf_counter()
    await model.register(backend)
    rows = [{"register_s": time.perf_counter() - started}]
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            groups = await tracerl.gather_trajectory_groups(
                tracerl.TrajectoryGroup(rollout(model, 10 + g * 8 + i) for i in range(8))
                for g in range(4))
            t1 = time.perf_counter()
            awake = used_gib()
            with MemorySampler() as during:
                metrics = await model.train(groups, config=tracerl.TrainConfig(learning_rate=1e-4))
            served = {c.adapter_step for g in groups for t in g for c in t.llm_calls}
            rows.append({"step": await model.get_step(), "rollout_s": t1 - t0,
                         "train_s": time.perf_counter() - t1, "loss": metrics.get("loss"),
                         "rollouts_served_by_adapter_step": sorted(served),
                         "gpu_used_gib_awake": awake, "gpu_used_gib_min_during_step": during.low,
                         "gpu_used_gib_max_during_step": during.high})
            print(json.dumps(rows[-1]), flush=True)
        [after] = await tracerl.gather_trajectory_groups(
            [tracerl.TrajectoryGroup(rollout(model, 3) for _ in range(2))])
        rows.append({"served_after_training_by_adapter_step":
                     sorted({c.adapter_step for t in after for c in t.llm_calls})})
    finally:
        await backend.close()
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return {"device": device, "shape": shape, "replicas_per_gpu": replicas_per_gpu, "rows": rows}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--shape", default="smollm2-135m", help="a shape of random_models.SHAPES")
    ap.add_argument("--gpu-memory-utilization", type=float,
                    help="vLLM's share of the GPU (default: vLLM's 0.9)")
    ap.add_argument("--replicas-per-gpu", type=int, default=1,
                    help="vLLM servers sharing the GPU (their memory: the share split K ways)")
    ap.add_argument("--json")
    args = ap.parse_args()
    result = asyncio.run(main(args.tokenizer, args.steps, args.shape, args.gpu_memory_utilization,
                              args.replicas_per_gpu))
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
