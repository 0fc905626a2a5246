"""Rollout throughput through the gateway: a replica set of K vLLM servers versus one server.

The same waves of concurrent two-turn rollouts (T=1, ``ignore_eos``, so each call generates
exactly ``--max-tokens``) go through the gateway, each rollout under its own id (so the replica
set routes sticky / least-loaded as in training), against each configuration in turn; completion
tokens/s per wave, median of the waves. Each configuration is started once (vLLM cold starts
are not timed).

    TRACERL_VLLM_PYTHON=.venv-vllm/bin/python PYTHONPATH=. .venv/bin/python \
        benchmarks/replicas_vs_one.py --replicas 1 2 --concurrency 8 --max-tokens 32 --waves 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
import uuid

import tracerl

MSGS = [{"role": "user", "content": "Tell me a story."}]


async def wave(model, concurrency: int, max_tokens: int) -> float:
    client = model.openai_client()

    async def rollout() -> int:
        tokens = 0
        messages = list(MSGS)
        with tracerl.rollout_scope(uuid.uuid4().hex):
            for _ in range(2):
                r = await client.chat.completions.create(
                    model=model.name, messages=messages, max_tokens=max_tokens,
                    temperature=1.0, extra_body={"ignore_eos": True})
                tokens += r.usage.completion_tokens
                messages += [r.choices[0].message.model_dump(exclude_none=True),
                             {"role": "user", "content": "Go on."}]
        return tokens

    started = time.perf_counter()
    tokens = sum(await asyncio.gather(*(rollout() for _ in range(concurrency))))
    return tokens / (time.perf_counter() - started)


async def measure(replicas: int, args: argparse.Namespace) -> list[float]:
    backend = tracerl.LocalBackend(path=tempfile.mkdtemp(prefix="tracerl-replica-bench-"),
                                   engine="vllm")
    model = tracerl.TrainableModel(
        name="bench", project="bench", base_model=args.base_model, config=tracerl.ModelConfig(
            engine=tracerl.EngineConfig(dtype="bfloat16", max_model_len=1024, max_num_seqs=16,
                                        replicas=replicas)))
    try:
        await model.register(backend)
        await wave(model, args.concurrency, args.max_tokens)  # warm-up
        return [await wave(model, args.concurrency, args.max_tokens) for _ in range(args.waves)]
    finally:
        await backend.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--waves", type=int, default=3)
    ap.add_argument("--base-model", default="smollm2")
    args = ap.parse_args()
    out = {}
    for k in args.replicas:
        waves = asyncio.run(measure(k, args))
        out[k] = {"waves_tok_s": [round(w, 1) for w in waves],
                  "median_tok_s": round(statistics.median(waves), 1)}
    base = out[args.replicas[0]]["median_tok_s"]
    for k in args.replicas:
        out[k]["ratio"] = round(out[k]["median_tok_s"] / base, 3)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
