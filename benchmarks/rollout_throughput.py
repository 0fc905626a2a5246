"""Rollout throughput under concurrency: completion tokens/s through the gateway versus the same
requests sent straight to the vLLM server it fronts (same process tree, model and requests).

Waves of ``--concurrency`` simultaneous chat requests alternate between the two paths
(``--waves`` of each, after one warm-up wave each); sampling at T=1 with ``ignore_eos`` so every
request generates exactly ``--max-tokens`` tokens on both paths. Through the gateway every
request is recorded token-exactly (ids, logprobs) under its own rollout id, as in training.

    TRACERL_VLLM_PYTHON=.venv-vllm/bin/python python benchmarks/rollout_throughput.py \
        --concurrency 16 --max-tokens 32 --waves 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx

import tracerl


async def run(concurrency: int, max_tokens: int, waves: int, base_model: str) -> dict:
    backend = tracerl.LocalBackend(path=tempfile.mkdtemp(), engine="vllm")
    model = tracerl.TrainableModel(
        name="bench", project="bench", base_model=base_model,
        config=tracerl.ModelConfig(engine=tracerl.EngineConfig(max_num_seqs=max(concurrency, 1))))
    await model.register(backend)
    engine = backend.gateway.models[model.name].engine
    body = {"max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True}
    limits = httpx.Limits(max_connections=concurrency * 2)
    direct_tps, gateway_tps = [], []
    try:
        async with httpx.AsyncClient(timeout=600, limits=limits) as http:
            async def one(i: int, via_gateway: bool) -> int:
                messages = [{"role": "user", "content": f"Write a story about the number {i}."}]
                if via_gateway:
                    r = await http.post(f"{model.inference_base_url}/chat/completions",
                                        headers={"x-rollout-id": f"ro-{i}"},
                                        json={**body, "messages": messages, "model": model.name})
                else:  # what the gateway asks of the engine, minus the gateway
                    r = await http.post(f"{engine.base_url}/v1/chat/completions", json={
                        **body, "messages": messages, "model": engine.spec.served_name,
                        "logprobs": True, "top_logprobs": 0, "return_token_ids": True})
                r.raise_for_status()
                return r.json()["usage"]["completion_tokens"]

            async def wave(w: int, via_gateway: bool) -> float:
                start = time.perf_counter()
                tokens = await asyncio.gather(*(one(w * concurrency + i, via_gateway)
                                                for i in range(concurrency)))
                return sum(tokens) / (time.perf_counter() - start)

            await wave(0, False), await wave(0, True)  # warm-up
            for w in range(1, waves + 1):
                direct_tps.append(await wave(w, False))
                gateway_tps.append(await wave(w, True))
        recorded = len(backend.gateway.calls.take(backend.store(model), f"ro-{concurrency}"))
    finally:
        await backend.close()
    d, g = statistics.median(direct_tps), statistics.median(gateway_tps)
    return {"concurrency": concurrency, "max_tokens": max_tokens, "waves": waves,
            "direct_tokens_per_s": d, "gateway_tokens_per_s": g, "ratio_gateway_over_direct": g / d,
            "direct_waves": direct_tps, "gateway_waves": gateway_tps,
            "calls_recorded_for_one_rollout": recorded}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--waves", type=int, default=3)
    ap.add_argument("--base-model", default="smollm2")
    ap.add_argument("--json")
    args = ap.parse_args()
    result = asyncio.run(run(args.concurrency, args.max_tokens, args.waves, args.base_model))
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
