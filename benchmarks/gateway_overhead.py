"""Gateway overhead per call: the same requests sent to the engine directly and through tracerl.

With ``--engine vllm`` the peer is the vLLM OpenAI server itself (same process tree, same
model, same request); requests alternate direct / gateway so both see the same machine state.
Reports p50/p95 latency of each path, the added latency and the ratio gateway/direct.

    TRACERL_VLLM_PYTHON=.venv-vllm/bin/python python benchmarks/gateway_overhead.py --engine vllm
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx2

import tracerl


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(int(q * len(xs)), len(xs) - 1)]


async def run(engine: str, requests: int, max_tokens: int) -> dict:
    backend = tracerl.LocalBackend(path=tempfile.mkdtemp(), engine=engine)
    model = tracerl.TrainableModel(name="bench", project="bench", base_model="smollm2")
    await model.register(backend)
    eng = backend.gateway.models[model.spec.key].engine
    body = {"messages": [{"role": "user", "content": "Say one word."}], "max_tokens": max_tokens,
            "temperature": 0}
    direct, gateway = [], []
    try:
        async with httpx2.AsyncClient(timeout=120) as http:
            direct_url = f"{eng.base_url}/v1/chat/completions" if engine == "vllm" else None

            async def via_direct() -> float:
                t = time.perf_counter()
                if direct_url:
                    r = await http.post(direct_url, json={**body, "model": eng.spec.served_name,
                                                          "logprobs": True,
                                                          "return_token_ids": True})
                    r.raise_for_status()
                else:
                    await backend.call_on_gateway(eng.chat({**body, "model": eng.spec.served_name,
                                                            "logprobs": True}))
                return time.perf_counter() - t

            async def via_gateway(i: int) -> float:
                t = time.perf_counter()
                r = await http.post(f"{model.inference_base_url}/chat/completions",
                                    headers={"x-rollout-id": f"ro-bench-{i}"},
                                    json={**body, "model": model.name})
                r.raise_for_status()
                return time.perf_counter() - t

            for i in range(3):  # warm-up
                await via_direct(), await via_gateway(i)
            for i in range(requests):
                direct.append(await via_direct())
                gateway.append(await via_gateway(i))
    finally:
        await backend.close()
    d50, g50 = statistics.median(direct), statistics.median(gateway)
    return {
        "engine": engine, "requests": requests, "max_tokens": max_tokens,
        "direct_p50_ms": d50 * 1e3, "direct_p95_ms": pct(direct, 0.95) * 1e3,
        "gateway_p50_ms": g50 * 1e3, "gateway_p95_ms": pct(gateway, 0.95) * 1e3,
        "added_p50_ms": (g50 - d50) * 1e3,
        "added_p95_ms": (pct(gateway, 0.95) - pct(direct, 0.95)) * 1e3,
        "ratio_gateway_over_direct_p50": g50 / d50,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", default="vllm", choices=["vllm", "transformers"])
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--max-tokens", type=int, default=1)
    ap.add_argument("--json")
    args = ap.parse_args()
    result = asyncio.run(run(args.engine, args.requests, args.max_tokens))
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
