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

``--gateway-variants url uvloop httptools groupfsync`` adds, in the same process and the same
alternating waves (the order of the paths rotates each round), one more gateway per variant,
each on its own thread and port and routing to the same vLLM server through ``replica_urls``:
``url`` is the control (the default gateway reaching the server as an existing URL), ``uvloop``
runs that gateway's loop on uvloop, ``httptools`` serves it with uvicorn's httptools parser
instead of tracerl's bounded h11 protocol (no head/write deadlines: a benchmark variant only),
``groupfsync`` makes its records durable with one ``syncfs`` per batch of records from one
writer thread (a prototype of group commit; every caller still waits until its record is on
disk). Each variant is compared with the direct path and with ``url`` wave by wave.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import os
import platform
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from unittest import mock

import aiohttp
import httpx2
from pyspy import start_profile, top_frames

import tracerl
from tracerl.backend.engines.vllm_engine import engine_connector, vllm_python
from tracerl.backend.gateway.recorder import CallStore, inject_training_fields
from tracerl.backend.local import freeze_long_lived_objects

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


GATEWAY_VARIANTS = ("url", "uvloop", "httptools", "groupfsync")


class GroupCommitCallStore(CallStore):
    """Prototype: callers hand their record to one writer thread and wait; the writer appends
    every record waiting (no fsync each) and then makes the whole batch durable with one
    ``syncfs(2)`` of the records' filesystem before releasing the callers."""

    def __init__(self, divert: Callable | None = None) -> None:
        super().__init__(divert)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._libc = ctypes.CDLL(None, use_errno=True)
        self.batch_sizes: list[int] = []
        threading.Thread(target=self._writer, name="tracerl-group-commit", daemon=True).start()

    def add(self, store, call) -> None:
        rid = call.rollout_id
        path = store.calls_path(rid) if rid is not None else store.unattributed_calls_path
        if rid is not None and self.divert is not None:
            path = self.divert(store, rid) or path
        item = [path, call.json_line() + b"\n", threading.Event(), None]
        self._queue.put(item)
        item[2].wait()
        if item[3] is not None:
            raise item[3]

    def _writer(self) -> None:
        while True:
            batch = [self._queue.get()]
            while True:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            error, fd = None, None
            try:
                for path, line, _, _ in batch:
                    with self._file_lock(path):
                        try:
                            f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                        except FileNotFoundError:
                            path.parent.mkdir(parents=True, exist_ok=True)
                            f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                        try:
                            written = 0
                            while written < len(line):
                                written += os.write(f, line[written:])
                        finally:
                            if fd is None:
                                fd = f
                            else:
                                os.close(f)
                if self._libc.syncfs(fd) != 0:
                    errno = ctypes.get_errno()
                    raise OSError(errno, os.strerror(errno))
            except OSError as e:
                error = e
            finally:
                if fd is not None:
                    os.close(fd)
            self.batch_sizes.append(len(batch))
            for item in batch:
                item[3] = error
                item[2].set()


@contextlib.contextmanager
def gateway_variant(kind: str) -> Iterator[None]:
    """What differs while the variant's gateway thread is created."""
    if kind == "uvloop":
        import uvloop

        with mock.patch("asyncio.new_event_loop", uvloop.new_event_loop):
            yield
    elif kind == "httptools":
        from tracerl.backend.gateway import http_limits

        options = http_limits.uvicorn_options
        with mock.patch.object(http_limits, "uvicorn_options",
                               lambda api_key=None: {**options(api_key), "http": "httptools"}):
            yield
    else:
        yield


async def variant_gateway(kind: str, server_url: str, base_model: str,
                          engine_config: dict) -> tuple:
    """A second gateway in this process, with ``kind``'s change, in front of ``server_url``."""
    from tracerl.backend.engines.url_engine import URLEngine
    from tracerl.backend.engines.vllm_engine import POOL_KEEP_ALIVE_S

    backend = tracerl.LocalBackend(path=tempfile.mkdtemp(), engine="vllm")
    with gateway_variant(kind):
        backend._gateway()  # its thread and loop, created now
    if kind == "groupfsync":
        backend.gateway.recorder.calls = GroupCommitCallStore(divert=backend.gateway.calls.divert)
    model = tracerl.TrainableModel(
        name=f"bench-{kind}", project="bench", base_model=base_model,
        config=tracerl.ModelConfig(engine=tracerl.EngineConfig(
            **engine_config, replica_urls=[server_url])))
    # the same idle-connection lifetime as the gateway that started the server
    with mock.patch.object(URLEngine, "connect",
                           lambda self, keepalive_s=POOL_KEEP_ALIVE_S:
                           super(URLEngine, self).connect(keepalive_s)):
        await model.register(backend)
    return backend, model


async def measure(concurrencies: list[int], max_tokens: int, waves: int, base_model: str,
                  vllm_args: list[str], client: str, profile: Path | None = None,
                  replicas: int = 1, variants: tuple[str, ...] = ()) -> list[dict]:
    backend = tracerl.LocalBackend(path=tempfile.mkdtemp(), engine="vllm")
    engine_config = dict(max_num_seqs=max(concurrencies), max_model_len=max(512, max_tokens + 128))
    model = tracerl.TrainableModel(
        name="bench", project="bench", base_model=base_model,
        config=tracerl.ModelConfig(engine=tracerl.EngineConfig(
            **engine_config, extra_args=vllm_args, replicas=replicas if replicas > 1 else None,
            replicas_per_gpu=replicas)))
    started = time.perf_counter()
    await model.register(backend)
    print(f"engine up in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    engine = backend.gateway.models[model.spec.key].engine
    if replicas > 1:  # the peer: one server of the set, called directly, the others idle
        engine = engine.replicas[0].engine
    body = {"max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True}
    results = []
    others = {}  # variant -> (backend, model)
    try:
        for kind in variants:
            others[kind] = await variant_gateway(kind, engine.base_url, base_model, engine_config)
        if variants:
            freeze_long_lived_objects()
        async with client_for(client, max(concurrencies)) as post:
            async def one(i: int, via_gateway: bool | str) -> int:
                messages = [{"role": "user", "content": f"Write a story about the number {i}."}]
                if isinstance(via_gateway, str):  # a variant gateway
                    m = others[via_gateway][1]
                    reply = await post(f"{m.inference_base_url}/chat/completions",
                                       {**body, "messages": messages, "model": m.name},
                                       {"x-rollout-id": f"ro-{i}"})
                elif via_gateway:
                    reply = await post(f"{model.inference_base_url}/chat/completions",
                                       {**body, "messages": messages, "model": model.name},
                                       {"x-rollout-id": f"ro-{i}"})
                else:  # what the gateway asks of the engine, minus the gateway
                    reply = await post(f"{engine.base_url}/v1/chat/completions",
                                       inject_training_fields("chat.completions", {
                                           **body, "messages": messages,
                                           "model": engine.spec.served_name}), {})
                return reply["usage"]["completion_tokens"]

            cpu_ms: dict = {False: [], True: [], **{k: [] for k in variants}}

            async def wave(first: int, concurrency: int, via_gateway: bool | str) -> float:
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
                for v in cpu_ms.values():
                    v.clear()
                variant_waves: dict[str, list[float]] = {k: [] for k in variants}
                for w in range(waves + 1):  # wave 0 warms up both paths
                    if variants:  # every path in turn, the order rotating each round
                        paths = [False, True, *variants]
                        paths = paths[w % len(paths):] + paths[:w % len(paths)]
                        got = {}
                        for path in paths:
                            got[path] = await wave(next_id, concurrency, path)
                        if w:
                            direct.append(got[False])
                            gateway.append(got[True])
                            for k in variants:
                                variant_waves[k].append(got[k])
                        next_id += concurrency
                        continue
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
                    "ratio_per_wave": [b / a for a, b in zip(direct, gateway, strict=True)],
                    "client_cpu_ms_per_call": cpu_direct,
                    "gateway_cpu_ms_per_call": cpu_gateway - cpu_direct})
                for k in variants:
                    vb, vm = others[k]
                    vw = variant_waves[k]
                    row = {"tokens_per_s": statistics.median(vw), "waves": vw,
                           "ratio_over_direct_per_wave": [
                               b / a for a, b in zip(direct, vw, strict=True)],
                           "gateway_cpu_ms_per_call":
                               statistics.median(cpu_ms[k][1:]) - cpu_direct,
                           "calls_recorded_for_one_rollout": len(vb.gateway.calls.take(
                               vb.store(vm), f"ro-{next_id - 1}"))}
                    row["ratio_over_direct"] = statistics.median(row["ratio_over_direct_per_wave"])
                    if "url" in variants and k != "url":
                        row["ratio_over_url_per_wave"] = [
                            b / a for a, b in zip(variant_waves["url"], vw, strict=True)]
                        row["ratio_over_url"] = statistics.median(row["ratio_over_url_per_wave"])
                    if k == "groupfsync":
                        sizes = vb.gateway.calls.batch_sizes
                        row["records_per_sync_mean"] = sum(sizes) / max(1, len(sizes))
                    results[-1].setdefault("variants", {})[k] = row
                print(json.dumps(results[-1]), flush=True)
    finally:
        for vb, _ in others.values():
            await vb.close()
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
    ap.add_argument("--gateway-variants", nargs="*", default=[], choices=GATEWAY_VARIANTS,
                    help="more gateways in the same waves (module docstring)")
    ap.add_argument("--json")
    args = ap.parse_args()
    base_model = args.base_model
    if args.random_init:
        from random_models import served_random_model

        base_model = served_random_model(args.random_init, args.tokenizer)
    rows = asyncio.run(measure(args.concurrency, args.max_tokens, args.waves, base_model,
                               args.vllm_arg, args.client,
                               Path(args.profile) if args.profile else None, args.replicas,
                               tuple(args.gateway_variants)))
    result = {"model": args.random_init or args.base_model, "client": args.client,
              "replicas": args.replicas,
              **environment(), "results": rows}
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
