"""A stand-in for vLLM's OpenAI server that answers at once, for measuring the gateway's own CPU
cost per call (with a real engine, generation hides it until hundreds of rollouts run at once).

It answers ``/health``, ``/v1/models`` and ``/v1/chat/completions`` with a reply of vLLM's
shape: ``max_tokens`` tokens, each with its logprob entry, token ids and prompt token ids; with
``stream`` set, as server-sent events of one token each (prompt token ids in the first, usage in
the last when ``stream_options.include_usage`` asks), sent with a ``Content-Length``.
Started by the vLLM engine in place of vLLM: point ``TRACERL_VLLM_PYTHON`` at
``benchmarks/instant_vllm`` (a wrapper that ignores ``-m vllm.entrypoints...``). Standard library
only, so any python3 runs it.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time


def reply(body: dict) -> dict:
    n = int(body.get("max_tokens") or 16)
    ids = [100 + i % 1000 for i in range(n)]
    entries = [{"token": f"t{i}", "logprob": -0.5, "bytes": [116], "top_logprobs": []} for i in ids]
    return {"id": "chatcmpl-instant", "object": "chat.completion", "created": int(time.time()),
            "model": body.get("model"),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": " ".join(
                f"t{i}" for i in ids), "tool_calls": []}, "logprobs": {"content": entries},
                "finish_reason": "length", "stop_reason": None, "token_ids": ids}],
            "usage": {"prompt_tokens": 20, "completion_tokens": n, "total_tokens": 20 + n},
            "prompt_logprobs": None, "prompt_token_ids": list(range(1, 21))}


def stream_events(body: dict) -> bytes:
    """The reply as vLLM streams it: one chunk per token, then ``[DONE]``."""
    full = reply(body)
    choice = full["choices"][0]
    base = {"id": full["id"], "object": "chat.completion.chunk", "created": full["created"],
            "model": full["model"]}
    chunks = [{**base, "prompt_token_ids": full["prompt_token_ids"], "choices": [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
         "finish_reason": None}]}]
    last = len(choice["token_ids"]) - 1
    for i, (token, entry) in enumerate(zip(choice["token_ids"], choice["logprobs"]["content"],
                                           strict=True)):
        chunks.append({**base, "choices": [
            {"index": 0, "delta": {"content": ("" if i == 0 else " ") + entry["token"]},
             "logprobs": {"content": [entry]}, "token_ids": [token],
             "finish_reason": "length" if i == last else None}]})
    if (body.get("stream_options") or {}).get("include_usage"):
        chunks.append({**base, "choices": [], "usage": full["usage"]})
    return b"".join(b"data: %s\n\n" % json.dumps(c).encode() for c in chunks) + \
        b"data: [DONE]\n\n"


async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, name: str) -> None:
    try:
        while True:  # HTTP/1.1 keep-alive: one request after another on this connection
            head = await reader.readuntil(b"\r\n\r\n")
            method, path = head.split(b" ", 2)[:2]
            length = 0
            for line in head.split(b"\r\n")[1:]:
                key, _, value = line.partition(b":")
                if key.strip().lower() == b"content-length":
                    length = int(value)
            body = json.loads(await reader.readexactly(length)) if length else {}
            kind = b"application/json"
            if path == b"/v1/chat/completions" and method == b"POST" and body.get("stream"):
                payload, kind = stream_events(body), b"text/event-stream"
            elif path == b"/v1/chat/completions" and method == b"POST":
                payload = json.dumps(reply(body)).encode()
            elif path == b"/v1/models":
                payload = json.dumps({"object": "list", "data": [{"id": name}]}).encode()
            else:
                payload = b"{}"
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: %s\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (kind, len(payload), payload))
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def main(argv: list[str]) -> None:
    port = int(argv[argv.index("--port") + 1])
    name = argv[argv.index("--served-model-name") + 1]
    server = await asyncio.start_server(lambda r, w: serve(r, w, name), "127.0.0.1", port,
                                        backlog=4096)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main(sys.argv))
