"""Rollout throughput under concurrency: completion tokens/s through the gateway versus the same
requests sent straight to the vLLM server it fronts (same process tree, model and requests).

For each ``--concurrency`` value, waves of that many simultaneous chat requests alternate between
the two paths (``--waves`` of each, after one warm-up wave each); sampling at T=1 with
``ignore_eos`` so every request generates exactly ``--max-tokens`` tokens on both paths. Through
the gateway every request is recorded token-exactly (ids, logprobs) under its own rollout id, as
in training. One engine serves all concurrency values. Besides tokens/s, each row gives this
process's CPU time per call on each path: the difference is the gateway's own CPU per call,
which wave timing hides until the gateway is the bottleneck (steadier than tokens/s on a busy
machine).

    TRACERL_VLLM_PYTHON=.venv-vllm/bin/python python benchmarks/rollout_throughput.py \
        --concurrency 8 --max-tokens 16 --waves 3
    # on a GPU, a random-initialised model of a real shape (values do not change speed):
    python benchmarks/rollout_throughput.py --random-init qwen2.5-0.5b --tokenizer TOKDIR \
        --concurrency 16 64 256 --max-tokens 256
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import httpx2
from pyspy import start_profile, top_frames

import tracerl
from tracerl.backend.engines.vllm_engine import engine_connector, vllm_python
from tracerl.backend.recorder import inject_training_fields

Post = Callable[[str, dict, dict], Awaitable[dict]]


@contextlib.asynccontextmanager
async def client_for(kind: str, concurrency: int) -> AsyncIterator[Post]:
    """One HTTP client for both paths: aiohttp with the gateway's own pool settings, or httpx2
    (what the openai SDK sends with) with a pool as large."""
    if kind == "aiohttp":
        async with aiohttp.ClientSession(connector=engine_connector(concurrency),
                                         timeout=aiohttp.ClientTimeout(total=600)) as session:
            async def post(url: str, body: dict, headers: dict) -> dict:
                async with session.post(url, json=body, headers=headers) as r:
                    r.raise_for_status()
                    return await r.json()
            yield post
    else:
        limits = httpx2.Limits(max_connections=max(1024, 8 * concurrency),
                               max_keepalive_connections=concurrency, keepalive_expiry=2.0)
        async with httpx2.AsyncClient(timeout=600, limits=limits) as http:
            async def post(url: str, body: dict, headers: dict) -> dict:
                r = await http.post(url, json=body, headers=headers)
                r.raise_for_status()
                return r.json()
            yield post


async def measure(concurrencies: list[int], max_tokens: int, waves: int, base_model: str,
                  vllm_args: list[str], client: str, profile: Path | None = None,
                  replicas: int = 1) -> list[dict]:
    backend = tracerl.LocalBackend(path=tempfile.mkdtemp(), engine="vllm")
    model = tracerl.TrainableModel(
        name="bench", project="bench", base_model=base_model,
        config=tracerl.ModelConfig(engine=tracerl.EngineConfig(
            max_num_seqs=max(concurrencies), max_model_len=max(512, max_tokens + 128),
            extra_args=vllm_args, replicas=replicas if replicas > 1 else None,
            replicas_per_gpu=replicas)))
    started = time.perf_counter()
    await model.register(backend)
    print(f"engine up in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    engine = backend.gateway.models[model.spec.key].engine
    if replicas > 1:  # the peer: one server of the set, called directly, the others idle
        engine = engine.replicas[0].engine
    body = {"max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True}
    results = []
    try:
        async with client_for(client, max(concurrencies)) as post:
            async def one(i: int, via_gateway: bool) -> int:
                messages = [{"role": "user", "content": f"Write a story about the number {i}."}]
                if via_gateway:
                    reply = await post(f"{model.inference_base_url}/chat/completions",
                                       {**body, "messages": messages, "model": model.name},
                                       {"x-rollout-id": f"ro-{i}"})
                else:  # what the gateway asks of the engine, minus the gateway
                    reply = await post(f"{engine.base_url}/v1/chat/completions",
                                       inject_training_fields("chat.completions", {
                                           **body, "messages": messages,
                                           "model": engine.spec.served_name}), {})
                return reply["usage"]["completion_tokens"]

            cpu_ms: dict[bool, list[float]] = {False: [], True: []}

            async def wave(first: int, concurrency: int, via_gateway: bool) -> float:
                start, cpu = time.perf_counter(), time.process_time()
                tokens = await asyncio.gather(*(one(first + i, via_gateway)
                                                for i in range(concurrency)))
                # this process's CPU (all its threads) per call: the client's alone on the
                # direct path, the client's and the gateway's through the gateway
                cpu_ms[via_gateway].append((time.process_time() - cpu) * 1e3 / concurrency)
                return sum(tokens) / (time.perf_counter() - start)

            next_id = 0
            for concurrency in concurrencies:
                direct, gateway = [], []
                cpu_ms[False].clear()
                cpu_ms[True].clear()
                for w in range(waves + 1):  # wave 0 warms up both paths
                    d = await wave(next_id, concurrency, False)
                    spy = None
                    if profile and w == waves and concurrency == max(concurrencies):
                        # this process holds the client and the gateway: where does its CPU go?
                        raw = profile / f"pyspy-gateway-c{concurrency}.txt"
                        spy = start_profile(os.getpid(), 6, raw)
                    g = await wave(next_id, concurrency, True)
                    if spy is not None:
                        spy.wait(timeout=120)
                        if raw.exists():
                            print(json.dumps({"profile_top_frames": top_frames(raw)}), flush=True)
                    if w:
                        direct.append(d)
                        gateway.append(g)
                    next_id += concurrency
                recorded = len(backend.gateway.calls.take(backend.store(model),
                                                          f"ro-{next_id - 1}"))
                d, g = statistics.median(direct), statistics.median(gateway)
                cpu_direct = statistics.median(cpu_ms[False][1:])  # after the warm-up wave
                cpu_gateway = statistics.median(cpu_ms[True][1:])
                results.append({
                    "concurrency": concurrency, "max_tokens": max_tokens, "waves": waves,
                    "direct_tokens_per_s": d, "gateway_tokens_per_s": g,
                    "ratio_gateway_over_direct": g / d, "direct_waves": direct,
                    "gateway_waves": gateway, "calls_recorded_for_one_rollout": recorded,
                    "client_cpu_ms_per_call": cpu_direct,
                    "gateway_cpu_ms_per_call": cpu_gateway - cpu_direct})
                print(json.dumps(results[-1]), flush=True)
    finally:
        await backend.close()
    return results


def environment() -> dict:
    """Where the numbers came from: accelerator and vLLM version."""
    info = {"machine": platform.machine()}
    try:
        import torch
        info["device"] = (torch.cuda.get_device_name(0) if torch.cuda.is_available()
                          else f"cpu ({torch.get_num_threads()} threads)")
    except ImportError:
        pass
    python = vllm_python()
    if python:
        probe = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"],
                               capture_output=True, text=True, timeout=300)
        info["vllm"] = probe.stdout.strip().splitlines()[-1] if probe.returncode == 0 else None
    return info


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--waves", type=int, default=3)
    ap.add_argument("--base-model", default="smollm2")
    ap.add_argument("--random-init", help="a shape from random_models.SHAPES instead of "
                    "--base-model (vocabulary sized to the tokenizer)")
    ap.add_argument("--tokenizer", help="tokenizer folder for --random-init (default: SmolLM2's)")
    ap.add_argument("--vllm-arg", action="append", default=[],
                    help="extra vLLM server flag, repeatable (e.g. --vllm-arg=--enforce-eager)")
    ap.add_argument("--client", choices=["aiohttp", "httpx2"], default="aiohttp",
                    help="the benchmark's HTTP client, the same for both paths")
    ap.add_argument("--profile", help="folder: py-spy samples this process (client + gateway) "
                    "during the last gateway wave of the highest concurrency")
    ap.add_argument("--replicas", type=int, default=1,
                    help="the gateway routes to a replica set of this many servers on the GPU; "
                    "the direct path calls one of them")
    ap.add_argument("--json")
    args = ap.parse_args()
    base_model = args.base_model
    if args.random_init:
        from random_models import served_random_model

        base_model = served_random_model(args.random_init, args.tokenizer)
    rows = asyncio.run(measure(args.concurrency, args.max_tokens, args.waves, base_model,
                               args.vllm_arg, args.client,
                               Path(args.profile) if args.profile else None, args.replicas))
    result = {"model": args.random_init or args.base_model, "client": args.client,
              "replicas": args.replicas,
              **environment(), "results": rows}
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
