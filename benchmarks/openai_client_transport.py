"""Rollouts/s through a LocalBackend with the openai SDK's two async transports: httpx2 (openai's
default) versus aiohttp (``openai.DefaultAioHttpClient``), and ``model.openai_client()`` itself
(aiohttp since session 6). Same process, same gateway, waves alternating between the clients.

Each rollout is one chat call inside ``gather_trajectory_groups`` (recorded by the gateway), so
the numbers include what a training script pays per call. Run it against an engine that answers
at once to see the client's and the gateway's CPU cost rather than generation:

    TRACERL_VLLM_PYTHON=benchmarks/instant_vllm python benchmarks/openai_client_transport.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time

import openai

import tracerl


async def measure(concurrencies: list[int], max_tokens: int, waves: int) -> list[dict]:
    backend = tracerl.LocalBackend(path=tempfile.mkdtemp(), engine="vllm")
    model = tracerl.TrainableModel(
        name="bench", project="bench", base_model="smollm2",
        config=tracerl.ModelConfig(engine=tracerl.EngineConfig(
            max_num_seqs=max(concurrencies), max_model_len=max(512, max_tokens + 128))))
    await model.register(backend)
    clients = {kind: openai.AsyncOpenAI(
        base_url=model.inference_base_url, api_key=model.inference_api_key or "none",
        http_client=cls(), max_retries=0)
        for kind, cls in (("httpx2", openai.DefaultAsyncHttpxClient),
                          ("aiohttp", openai.DefaultAioHttpClient))}
    clients["model_openai_client"] = model.openai_client()

    async def rollout(client: openai.AsyncOpenAI, i: int) -> tracerl.Trajectory:
        r = await client.chat.completions.create(
            model=model.name, max_tokens=max_tokens, temperature=1.0,
            messages=[{"role": "user", "content": f"Write a story about the number {i}."}],
            extra_headers=tracerl.rollout_headers(model), extra_body={"ignore_eos": True})
        return tracerl.Trajectory(messages_and_choices=[r.choices[0]], reward=0.0)

    results = []
    try:
        next_id = 0
        for concurrency in concurrencies:
            rates: dict[str, list[float]] = {kind: [] for kind in clients}
            for w in range(waves + 1):  # wave 0 warms up both
                for kind, client in clients.items():
                    start = time.perf_counter()
                    [group] = await tracerl.gather_trajectory_groups([tracerl.TrajectoryGroup(
                        rollout(client, next_id + i) for i in range(concurrency))])
                    assert all(len(t.llm_calls) == 1 for t in group), "a call went unrecorded"
                    if w:
                        rates[kind].append(concurrency / (time.perf_counter() - start))
                    next_id += concurrency
            row = {"concurrency": concurrency, "max_tokens": max_tokens, "waves": waves,
                   **{f"{k}_rollouts_per_s": statistics.median(v) for k, v in rates.items()},
                   **{f"ratio_{k}_over_httpx2":
                      statistics.median(rates[k]) / statistics.median(rates["httpx2"])
                      for k in ("aiohttp", "model_openai_client")}}
            results.append(row)
            print(json.dumps(row), flush=True)
    finally:
        for kind, client in clients.items():
            if kind != "model_openai_client":  # that one closes with the loop
                await client.close()
        await backend.close()
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--waves", type=int, default=3)
    args = ap.parse_args()
    asyncio.run(measure(args.concurrency, args.max_tokens, args.waves))


if __name__ == "__main__":
    main()
