"""The transformers engine's continuous batcher against its former static batcher (issue 40).

The same load runs on both batchers in one process (SmolLM2-135M-Instruct, the transformers
engine called in-process, greedy): ``--concurrency`` tool-agent-like rollouts, each a loop of
``--turns`` chat calls (a system prompt naming a tool, a question, then for each later turn the
previous answer and a tool result appended). Every ``--long-every``-th rollout asks for long
completions (``--long-tokens``), the rest for short ones (``--short-tokens``), so short calls
meet long ones in flight, as in an agent evaluation. Rollouts start ``--stagger-s`` apart.

Per batcher: the worst and p50/p99 wait from a call's submission to its first sampled token (its
queue wait plus prefill), p50/p99 call latency, completion tokens/s over the wave's wall time;
then the ratios continuous/static. ``--waves`` > 1 alternates the batchers (continuous first in
each pair) and reports the median ratio.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/engine_batching.py --concurrency 24
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

from tracerl.backend.engines.transformers_engine import TransformersEngine
from tracerl.backend.weights import resolve_base_model
from tracerl.core.config import EngineConfig, LoraConfig
from tracerl.core.engine import EngineSpec

SYSTEM = ("You are a helpful agent with one tool, search(query). Call it when you need facts, "
          "then answer.")
LONG = ["Write a detailed plan, step by step, for a trip through {topic}.",
        "Count from 1 to 200, separated by commas, then say {topic}."]
SHORT = ["Which tool would you call to learn about {topic}? One word.",
         "Say yes or no: is {topic} a place?"]
TOPICS = ["Norway", "the Alps", "Kyoto", "Lisbon", "the Sahara", "Chile", "Iceland", "Peru"]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(int(q * len(xs)), len(xs) - 1)]


class Wave:
    """One wave's per-call numbers."""

    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.tokens = 0


async def rollout(engine: TransformersEngine, i: int, args: argparse.Namespace,
                  wave: Wave) -> None:
    await asyncio.sleep(i * args.stagger_s)  # the arrival schedule, part of the load
    long = i % args.long_every == 0
    topic = TOPICS[i % len(TOPICS)]
    question = (LONG if long else SHORT)[i // args.long_every % 2].format(topic=topic)
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                      {"role": "user", "content": question}]
    for turn in range(args.turns):
        body = {"model": engine.spec.served_name, "messages": messages, "temperature": 0.0,
                "max_tokens": args.long_tokens if long else args.short_tokens}
        t = time.perf_counter()
        answer = await engine.chat(body)
        wave.latencies.append(time.perf_counter() - t)
        wave.tokens += answer["usage"]["completion_tokens"]
        messages = [*messages, answer["choices"][0]["message"],
                    {"role": "user", "content": f"search returned: result {turn} about {topic}. "
                                                "Go on."}]


async def run_wave(engine: TransformersEngine, args: argparse.Namespace) -> dict[str, float]:
    engine.first_token_waits.clear()
    wave = Wave()
    t = time.perf_counter()
    await asyncio.gather(*(rollout(engine, i, args, wave) for i in range(args.concurrency)))
    wall = time.perf_counter() - t
    waits = list(engine.first_token_waits)
    return {"calls": len(wave.latencies), "tokens": wave.tokens, "wall_s": wall,
            "tok_s": wave.tokens / wall, "wait_max_s": max(waits), "wait_p50_s": pct(waits, 0.5),
            "wait_p99_s": pct(waits, 0.99), "latency_p50_s": pct(wave.latencies, 0.5),
            "latency_p99_s": pct(wave.latencies, 0.99)}


async def main(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    path = resolve_base_model("smollm2")
    config = EngineConfig(max_model_len=1024, max_num_seqs=args.max_num_seqs)
    engines = {}
    for batching in ("continuous", "static"):
        engine = TransformersEngine(EngineSpec(path, path.name, config, LoraConfig()),
                                    _batching=batching)  # type: ignore[arg-type]
        await engine.start()
        engines[batching] = engine
    await asyncio.gather(*(e.chat({"model": e.spec.served_name, "max_tokens": 2,  # warm-up
                                   "messages": [{"role": "user", "content": "Hi"}]})
                           for e in engines.values()))
    results: dict[str, list[dict[str, float]]] = {b: [] for b in engines}
    try:
        for w in range(args.waves):
            for batching, engine in engines.items():
                results[batching].append(await run_wave(engine, args))
                print(f"wave {w} {batching}: {json.dumps(results[batching][-1], default=float)}",
                      flush=True)
    finally:
        for engine in engines.values():
            await engine.stop()
    report(results)


def report(results: dict[str, list[dict[str, float]]]) -> None:
    print("\n| measure | continuous | static | continuous/static |\n|---|---|---|---|")
    for key in ("wait_max_s", "wait_p50_s", "wait_p99_s", "latency_p50_s", "latency_p99_s",
                "tok_s", "tokens", "wall_s"):
        c = statistics.median(r[key] for r in results["continuous"])
        s = statistics.median(r[key] for r in results["static"])
        ratios = [rc[key] / rs[key] for rc, rs in zip(results["continuous"], results["static"],
                                                       strict=True)]
        print(f"| {key} | {c:.2f} | {s:.2f} | {statistics.median(ratios):.2f} "
              f"({min(ratios):.2f}-{max(ratios):.2f}) |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=24)
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--long-every", type=int, default=4)
    parser.add_argument("--long-tokens", type=int, default=96)
    parser.add_argument("--short-tokens", type=int, default=16)
    parser.add_argument("--stagger-s", type=float, default=0.05)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--waves", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    asyncio.run(main(parser.parse_args()))
