"""Serving speed with a LoRA adapter versus the base model, on one vLLM server (same run).

Rollouts during training are always served through the adapter, so this ratio, not the base
model's speed, is the real rollout speed. Waves of ``--concurrency`` simultaneous chat requests
(T=1, ``ignore_eos``, exactly ``--max-tokens`` tokens each, logprobs and token ids asked as the
gateway asks) alternate between the base model and each adapter, straight to the server; median
tokens/s per path and the ratio adapter / base.

Adapters are random (B ~ N(0, 0.05)) peft LoRAs of rank ``--rank`` on ``--targets`` sets:
``all`` = tracerl's default (every linear projection), ``qv`` = q_proj and v_proj.

``--profile`` samples vLLM's processes (API server, engine core, workers) with py-spy during
one adapter wave of the highest concurrency; the top frames per process (where the CPU goes) go
into the JSON, the raw stacks beside it.

    TRACERL_VLLM_PYTHON=.venv-vllm/bin/python python benchmarks/adapter_serving.py \
        --concurrency 4 --max-tokens 16 --waves 2
    # on a GPU (benchmarks/gpu/vllm_run.sh adapter):
    python benchmarks/adapter_serving.py --random-init smollm2-135m --tokenizer TOK \
        --concurrency 64 256 --max-tokens 256 --profile
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from pyspy import start_profile, top_frames

import tracerl
from tracerl.backend.engines.vllm_engine import engine_connector
from tracerl.backend.gateway.recorder import inject_training_fields

TARGETS = {"all": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
           "qv": ["q_proj", "v_proj"]}


def random_lora(base: Path, out: Path, targets: list[str], rank: int) -> Path:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16),
                           LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets,
                                      task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    model.save_pretrained(out)
    return out


async def measure(args: argparse.Namespace, base_model: str) -> dict:
    backend = tracerl.LocalBackend(path=tempfile.mkdtemp(), engine="vllm")
    model = tracerl.TrainableModel(
        name="bench", project="bench", base_model=base_model,
        config=tracerl.ModelConfig(
            engine=tracerl.EngineConfig(max_num_seqs=max(args.concurrency),
                                        max_model_len=max(512, args.max_tokens + 128),
                                        extra_args=args.vllm_arg),
            lora=tracerl.LoraConfig(r=args.rank)))
    started = time.perf_counter()
    await model.register(backend)
    print(f"engine up in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    engine = backend.gateway.models[model.spec.key].engine
    folder = Path(tempfile.mkdtemp())
    paths = {"base": engine.spec.served_name}
    for targets in args.targets:
        path = random_lora(engine.spec.model_path, folder / targets, TARGETS[targets], args.rank)
        paths[f"lora-{targets}"] = path
    out_dir = Path(args.json).parent if args.json else Path(".")
    results: dict = {"rows": [], "profile": {}}
    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(connector=engine_connector(max(args.concurrency)),
                                     timeout=timeout) as http:
        for name, path in paths.items():
            if name == "base":
                continue
            async with http.post(f"{engine.base_url}/v1/load_lora_adapter",
                                 json={"lora_name": name, "lora_path": str(path)}) as r:
                if r.status != 200:
                    raise RuntimeError(f"vLLM refused {name}: {await r.text()}")

        async def one(i: int, served: str) -> int:
            body = inject_training_fields("chat.completions", {
                "model": served, "max_tokens": args.max_tokens, "temperature": 1.0,
                "ignore_eos": True,
                "messages": [{"role": "user", "content": f"Write a story about {i}."}]})
            async with http.post(f"{engine.base_url}/v1/chat/completions", json=body) as r:
                r.raise_for_status()
                return (await r.json())["usage"]["completion_tokens"]

        async def wave(first: int, concurrency: int, served: str) -> float:
            start = time.perf_counter()
            tokens = await asyncio.gather(*(one(first + i, served) for i in range(concurrency)))
            return sum(tokens) / (time.perf_counter() - start)

        next_id = 0
        for concurrency in args.concurrency:
            waves: dict[str, list[float]] = {name: [] for name in paths}
            for w in range(args.waves + 1):  # wave 0 warms every path up
                for name in paths:
                    served = name if name != "base" else paths["base"]
                    spy = None
                    profiling = (args.profile and w == args.waves and name != "base"
                                 and concurrency == max(args.concurrency))
                    if profiling:
                        raw = out_dir / f"pyspy-vllm-{name}-c{concurrency}.txt"
                        spy = start_profile(engine.process.pid, args.profile_s, raw,
                                            subprocesses=True)
                    rate = await wave(next_id, concurrency, served)
                    next_id += concurrency
                    if spy is not None:
                        spy.wait(timeout=args.profile_s + 60)
                        if raw.exists():
                            results["profile"][name] = top_frames(raw)
                    if w:
                        waves[name].append(rate)
            base = statistics.median(waves["base"])
            row = {"concurrency": concurrency, "max_tokens": args.max_tokens,
                   "base_tokens_per_s": base, "base_waves": waves["base"]}
            for name in paths:
                if name != "base":
                    row[f"{name}_tokens_per_s"] = statistics.median(waves[name])
                    row[f"{name}_over_base"] = statistics.median(waves[name]) / base
                    row[f"{name}_waves"] = waves[name]
            results["rows"].append(row)
            print(json.dumps(row), flush=True)
    await backend.close()
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, nargs="+", default=[4])
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--waves", type=int, default=3)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--targets", nargs="+", choices=sorted(TARGETS), default=["all", "qv"])
    ap.add_argument("--base-model", default="smollm2")
    ap.add_argument("--random-init", help="a shape from random_models.SHAPES")
    ap.add_argument("--tokenizer", help="tokenizer folder for --random-init")
    ap.add_argument("--vllm-arg", action="append", default=[])
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--profile-s", type=int, default=8)
    ap.add_argument("--json")
    args = ap.parse_args()
    base_model = args.base_model
    if args.random_init:
        from random_models import random_model_dir

        base_model = str(random_model_dir(args.random_init, Path(args.tokenizer),
                                          vocab="tokenizer"))
    result = {"model": args.random_init or args.base_model, "rank": args.rank,
              "vllm_args": args.vllm_arg, "pid": os.getpid(),
              **asyncio.run(measure(args, base_model))}
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
