"""Per-call latency the LiteLLM proxy (``tracerl proxy``) adds over calling the gateway directly.

Peer: the same request sent straight to the same gateway. One gateway, one real LiteLLM proxy
process in front of it (``LiteLLMProxy``, as ``tracerl proxy`` starts it); rounds of
``concurrency`` simultaneous calls alternate direct / proxy (ABAB, the order flipped every
round) so drift hits both. For each case (streamed or not, each concurrency) it reports per-call
median and p90 of each path and the added latency: the median over paired calls (call i of a
direct round with call i of the proxy round next to it) of proxy minus direct, per repeat; the
spread is over repeats. Every proxy call carries its own rollout id, and the benchmark checks
that the gateway recorded each one token-exactly under it. It also reports the proxy process's CPU
time per proxied call (Linux ``/proc``): on a busy box the steadier measure of its own cost.

Engines: ``instant`` (default) is a real HTTP server that answers at once with vLLM's reply
shape (``benchmarks/instant_vllm.py``, started by the vLLM engine in its place), so the few ms
asked about are not lost in generation noise; ``transformers`` is SmolLM2 on the CPU.

    TRACERL_LITELLM_PYTHON=.venv-litellm/bin/python python benchmarks/proxy_overhead.py \
        --concurrency 1 8 --calls 40 --repeats 3 [--profile DIR] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from pyspy import start_profile, top_frames

import tracerl
from tracerl.backend.engines.vllm_engine import engine_connector
from tracerl.integrations.litellm_proxy import LiteLLMProxy

INSTANT_VLLM = Path(__file__).resolve().parent / "instant_vllm"


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of process ``pid`` and its children so far (Linux), else None."""
    try:
        pids = [pid, *(int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text()
                       .split())]
        ticks = 0
        for p in pids:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])
    except (OSError, ValueError):
        return None
    return ticks / os.sysconf("SC_CLK_TCK")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(int(q * len(xs)), len(xs) - 1)]


async def timed_call(session: aiohttp.ClientSession, url: str, body: dict,
                     headers: dict) -> float:
    """Seconds until the whole reply (every event of a stream) has arrived."""
    started = time.perf_counter()
    async with session.post(url, json=body, headers=headers) as r:
        if r.status != 200:
            raise RuntimeError(f"{url}: {r.status} {await r.text()}")
        await r.read()
    return time.perf_counter() - started


async def measure(args: argparse.Namespace) -> list[dict]:
    if args.engine == "instant":
        os.environ["TRACERL_VLLM_PYTHON"] = str(INSTANT_VLLM)
    backend = tracerl.LocalBackend(path=tempfile.mkdtemp(prefix="tracerl-proxy-bench-"),
                                   engine="vllm" if args.engine == "instant" else args.engine)
    model = tracerl.TrainableModel(name="bench", project="bench", base_model="smollm2")
    await model.register(backend)
    proxy = LiteLLMProxy(upstream_base_url=backend.base_url, model_names=[model.name],
                         workers=args.proxy_workers,
                         directory=Path(tempfile.mkdtemp(prefix="tracerl-proxy-bench-proxy-")))
    await asyncio.to_thread(proxy.start)
    print(f"proxy up at {proxy.base_url} (pid {proxy.process.pid})", file=sys.stderr, flush=True)
    paths = {"direct": (f"{model.inference_base_url}/chat/completions", {}),
             "proxy": (f"{proxy.base_url}/chat/completions",
                       {"Authorization": f"Bearer {proxy.master_key}"})}
    results = []
    serial = 0
    try:
        async with aiohttp.ClientSession(connector=engine_connector(max(args.concurrency)),
                                         timeout=aiohttp.ClientTimeout(total=600)) as session:
            async def round_of(path: str, concurrency: int, stream: bool) -> list[float]:
                nonlocal serial
                url, headers = paths[path]
                calls = []
                for _ in range(concurrency):
                    serial += 1
                    body = {"model": model.name, "max_tokens": args.max_tokens,
                            "temperature": 0, "stream": stream,
                            "messages": [{"role": "user", "content": f"Say {serial}."}]}
                    calls.append(timed_call(session, url, body,
                                            {**headers, "x-rollout-id": f"ro-{path}-{serial}"}))
                return list(await asyncio.gather(*calls))

            for stream in (False, True):
                for concurrency in args.concurrency:
                    case = {"stream": stream, "concurrency": concurrency}
                    for order in (("direct", "proxy"), ("proxy", "direct")):  # warm-up
                        for path in order:
                            await round_of(path, concurrency, stream)
                    repeats = []
                    rounds = max(1, args.calls // concurrency)
                    for repeat in range(args.repeats + bool(args.profile)):
                        lat: dict[str, list[float]] = {"direct": [], "proxy": []}
                        paired: list[float] = []
                        spy = None
                        if repeat == args.repeats:  # an extra repeat, profiled, not counted
                            raw = Path(args.profile) / (
                                f"pyspy-proxy-{'stream' if stream else 'plain'}-c{concurrency}"
                                ".txt")
                            spy = start_profile(proxy.process.pid, args.profile_s, raw,
                                                subprocesses=True)
                        cpu_before = cpu_seconds(proxy.process.pid)
                        for i in range(rounds):
                            order = ("direct", "proxy") if i % 2 == 0 else ("proxy", "direct")
                            got = {p: await round_of(p, concurrency, stream) for p in order}
                            for p in got:
                                lat[p].extend(got[p])
                            paired.extend(b - a for a, b in zip(got["direct"], got["proxy"],
                                                                strict=True))
                        cpu_after = cpu_seconds(proxy.process.pid)
                        if spy is not None:
                            spy.wait(timeout=args.profile_s + 60)
                            if raw.exists():
                                case["profile_top_frames"] = top_frames(raw, 30)
                            continue
                        repeats.append({
                            "direct_p50_ms": statistics.median(lat["direct"]) * 1e3,
                            "direct_p90_ms": pct(lat["direct"], 0.9) * 1e3,
                            "proxy_p50_ms": statistics.median(lat["proxy"]) * 1e3,
                            "proxy_p90_ms": pct(lat["proxy"], 0.9) * 1e3,
                            "added_ms": statistics.median(paired) * 1e3,
                            "proxy_cpu_ms_per_call": None if cpu_before is None else
                            (cpu_after - cpu_before) / len(lat["proxy"]) * 1e3})
                    added = [r["added_ms"] for r in repeats]
                    case.update({
                        "calls_per_path_per_repeat": rounds * concurrency,
                        "added_ms_median": statistics.median(added),
                        "added_ms_min": min(added), "added_ms_max": max(added),
                        **{k: statistics.median(r[k] for r in repeats) for k in repeats[0]
                           if k != "added_ms" and repeats[0][k] is not None},
                        "repeats": repeats})
                    # the last proxy call of the case, and of the whole run: recorded under it?
                    case["last_proxy_call_recorded"] = await recorded(model, serial)
                    results.append(case)
                    print(json.dumps({k: v for k, v in case.items()
                                      if k not in ("repeats", "profile_top_frames")}), flush=True)
    finally:
        proxy.stop()
        await backend.close()
    return results


async def recorded(model: tracerl.TrainableModel, serial: int) -> bool:
    """Whether the newest proxy call's rollout holds exactly one call with a logprob per token."""
    for n in range(serial, 0, -1):
        calls = await model.fetch_calls(f"ro-proxy-{n}")
        if calls:
            (call,) = calls
            c = call.completions[0]
            return len(c.token_ids) == len(c.logprobs) > 0
    return False


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=["instant", "transformers"], default="instant")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--calls", type=int, default=40, help="calls per path per repeat and case")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--proxy-workers", type=int, default=1, help="the proxy's worker processes")
    ap.add_argument("--profile", help="folder: py-spy samples the proxy process during one more "
                    "repeat of each case, left out of the numbers")
    ap.add_argument("--profile-s", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    rows = asyncio.run(measure(args))
    result = {"engine": args.engine, "max_tokens": args.max_tokens,
              "proxy_workers": args.proxy_workers,
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "results": rows}
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
