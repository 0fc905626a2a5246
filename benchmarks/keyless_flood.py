"""Keyed calls and ``/health`` while a keyless client floods the gateway with half-sent requests.

Peer: the same calls on the same gateway with no flood, measured in the same run. The gateway is
the real one (``LocalBackend`` with an API key, its uvicorn and tracerl's protocol, in this
process); the flood is a second process (``flood`` below) that holds ``--connections`` slots from
one address (127.0.0.2), each sending half a request head and no key, and opens a new one the
moment the server closes one: a continuous flood. Each case makes ``--calls`` keyed
``GET /v1/models`` and as many ``GET /health``, each on a fresh connection from 127.0.0.1, and
reports their status codes and latency (median, p95, max), with the flood's connections the
server held open and how many it refused or closed; then the same calls from the flood's own
address (a keyed client behind the flooder's NAT), which shares that address's cap.

    python benchmarks/keyless_flood.py --connections 4200 --calls 50 [--json out.json]
    python benchmarks/keyless_flood.py flood HOST PORT N   # the flood alone, until killed
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HALF_HEAD = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\n"
             b"Content-Type: application/json\r\n")  # no blank line: the head never ends
FLOOD_SOURCE = "127.0.0.2"
KEY = "sk-bench-flood"


async def _slot(host: str, port: int, source: str, stats: dict[str, int],
                first: asyncio.Event) -> None:
    """One flood connection, reopened each time the server ends it."""
    while True:
        try:
            reader, writer = await asyncio.open_connection(host, port, local_addr=(source, 0))
            writer.write(HALF_HEAD)
            await writer.drain()
            stats["open"] += 1
            first.set()
            try:
                await reader.read(-1)  # until the server closes or aborts it
            except OSError:
                pass
            stats["open"] -= 1
            stats["ended"] += 1
            writer.close()
        except OSError:
            stats["failed"] += 1
            first.set()
            await asyncio.sleep(0)  # refused before the head went out: at once again


async def flood(host: str, port: int, connections: int, source: str = FLOOD_SOURCE) -> None:
    """Hold ``connections`` half-sent keyless requests open; print one JSON line when each slot
    has tried once, then one a second with the counts, until killed."""
    stats = {"open": 0, "ended": 0, "failed": 0}
    firsts = [asyncio.Event() for _ in range(connections)]
    tasks = [asyncio.create_task(_slot(host, port, source, stats, e)) for e in firsts]
    async with asyncio.timeout(120):
        await asyncio.gather(*(e.wait() for e in firsts))
    print(json.dumps({"ready": True, **stats}), flush=True)
    while True:
        await asyncio.sleep(1)  # a report a second, for whoever reads the output
        print(json.dumps({**stats, "slots": len(tasks)}), flush=True)


async def timed_get(host: str, port: int, path: str, key: str | None, source: str
                    ) -> tuple[int, float]:
    """Status and seconds of one GET on a fresh connection from ``source`` (raw sockets: no
    pool to hide it); status 0: the server closed the connection without an answer."""
    started = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, port, local_addr=(source, 0))
    try:
        auth = f"Authorization: Bearer {key}\r\n" if key else ""
        writer.write(f"GET {path} HTTP/1.1\r\nHost: gateway\r\n{auth}Connection: close\r\n\r\n"
                     .encode())
        status_line = await reader.readline()
        await reader.read(-1)
    except OSError:
        status_line = b""
    finally:
        writer.close()
    status = int(status_line.split()[1]) if status_line else 0
    return status, time.perf_counter() - started


async def measure(host: str, port: int, calls: int, source: str = "127.0.0.1"
                  ) -> dict[str, object]:
    out: dict[str, object] = {}
    for name, path, key in (("keyed", "/v1/models", KEY), ("health", "/health", None)):
        codes, seconds = [], []
        for _ in range(calls):
            code, s = await asyncio.wait_for(timed_get(host, port, path, key, source), 60)
            codes.append(code)
            seconds.append(s)
        seconds.sort()
        out[name] = {"ok": codes.count(200), "other": sorted(set(codes) - {200}),
                     "median_ms": round(statistics.median(seconds) * 1000, 2),
                     "p95_ms": round(seconds[int(0.95 * (len(seconds) - 1))] * 1000, 2),
                     "max_ms": round(seconds[-1] * 1000, 2)}
    return out


async def bench(args: argparse.Namespace) -> dict[str, object]:
    import tracerl

    os.environ["TRACERL_HEAD_TIMEOUT_S"] = str(args.head_timeout)
    backend = tracerl.LocalBackend(path=tempfile.mkdtemp(prefix="flood-"), api_key=KEY)
    gateway = backend._gateway()  # started here: its server state is read below
    host, port = gateway.host, gateway.port
    result: dict[str, object] = {"connections": args.connections, "calls": args.calls,
                                 "machine": platform.platform(), "cpus": os.cpu_count(),
                                 "date": time.strftime("%Y-%m-%d")}
    try:
        result["no_flood"] = await measure(host, port, args.calls)
        proc = subprocess.Popen([sys.executable, __file__, "flood", host, str(port),
                                 str(args.connections)], stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None
            ready = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 180)
            result["flood_ready"] = json.loads(ready)
            state = gateway.server.server_state
            result["flood"] = await measure(host, port, args.calls)
            # a keyed client behind the flood's own address (one NAT): it shares that cap
            result["flood_same_address"] = await measure(host, port, args.calls, FLOOD_SOURCE)
            admission = getattr(state, "tracerl_admission", None)
            result["server_connections_under_flood"] = len(state.connections)
            if admission is not None:
                result["unkeyed_from_flood_address"] = len(admission.by_client.get(
                    FLOOD_SOURCE, {}))
                result["refused"] = admission.refused
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
    finally:
        await backend.close()
    return result


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "flood":
        host, port, n = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
        signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
        asyncio.run(flood(host, port, n))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--connections", type=int, default=4200)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--head-timeout", type=float, default=10.0,
                        help="TRACERL_HEAD_TIMEOUT_S of the gateway (its default: 10)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = asyncio.run(bench(args))
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
