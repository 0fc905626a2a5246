"""Cost of recording calls to disk in a burst: the gateway's CallStore.add (serialise, append,
fsync; one new file per rollout) versus a plain append of the same line without fsync (peer),
each from a pool of worker threads as the gateway does, same records, same process.

A burst is N rollouts whose calls (256 completion tokens with logprobs each) end together,
as when a wave of rollouts finishes; the ratio shows what fsync costs on this machine's disk.
Also timed alone, per record: encoding it as CallStore does (``LLMCall.json_line``,
pydantic-core) versus ``json.dumps`` of ``model_dump`` (peer): CPU the gateway spends holding
the GIL for every call.

    python benchmarks/call_record_write.py [--calls 256] [--tokens 256] [--threads 32]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tracerl.backend.gateway.recorder import CallStore, build_call
from tracerl.core.storage import ModelStore


def response(tokens: int) -> dict:
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
            "prompt_token_ids": list(range(40)),
            "choices": [{"index": 0, "finish_reason": "length", "token_ids": list(range(tokens)),
                         "message": {"role": "assistant", "content": "word " * tokens},
                         "logprobs": {"content": [{"token": "word", "logprob": -1.5,
                                                   "bytes": [119, 111, 114, 100],
                                                   "top_logprobs": []}
                                                  for _ in range(tokens)]}}],
            "usage": {"prompt_tokens": 40, "completion_tokens": tokens,
                      "total_tokens": 40 + tokens}}


def plain_append(folder: Path, call) -> None:
    with open(folder / f"{call.rollout_id}.jsonl", "a") as f:
        f.write(json.dumps(call.model_dump(mode="json")) + "\n")


def burst(calls: list, threads: int, add, where) -> float:
    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda call: add(where, call), calls))
    return time.perf_counter() - started


def encode_us(calls: list, encode) -> float:
    """Best of 3 passes: microseconds per record."""
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        for call in calls:
            encode(call)
        best = min(best, time.perf_counter() - started)
    return best / len(calls) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": args.tokens}
    calls = [build_call(endpoint="chat.completions", caller_body=body,
                        response=response(args.tokens), rollout_id=f"ro-{i}", model="m",
                        adapter_step=0, latency_s=0.1, streamed=False)
             for i in range(args.calls)]
    ours, peer = [], []
    for r in range(args.repeats):
        ours.append(burst(calls, args.threads, CallStore().add,
                          ModelStore(tempfile.mkdtemp(), "bench", f"m{r}")))
        peer.append(burst(calls, args.threads, plain_append, Path(tempfile.mkdtemp())))
    o, p = min(ours), min(peer)
    encode = encode_us(calls, lambda call: call.json_line())
    encode_peer = encode_us(calls, lambda call: json.dumps(call.model_dump(mode="json"),
                                                           allow_nan=False))
    print(json.dumps({"calls": args.calls, "tokens": args.tokens, "threads": args.threads,
                      "callstore_ms_per_burst": o * 1e3, "plain_append_ms_per_burst": p * 1e3,
                      "ratio_callstore_over_plain": o / p,
                      "encode_us_per_record": encode, "json_dumps_us_per_record": encode_peer,
                      "ratio_encode_over_json_dumps": encode / encode_peer}, indent=2))


if __name__ == "__main__":
    main()
