"""A small real OpenAI-compatible server process standing for one vLLM replica, for routing tests.

``python tests/replica_server.py NAME PORT`` (PORT 0: any; the port is printed on stdout).
It answers /health, chat completions (plain and streamed, vLLM's token ids and logprobs, and
``system_fingerprint`` = NAME so a test sees which replica answered), and vLLM's runtime LoRA
routes. A request with ``"x_hold": true`` waits until ``POST /_release`` (``/_rearm`` holds
again); a streamed one sends its first chunk, then waits, so a test can kill the process
mid-stream. ``GET /_state`` tells the adapters loaded and calls held. Used where routing is
under test, never in place of vLLM's behaviour.
"""

from __future__ import annotations

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

NAME = sys.argv[1] if len(sys.argv) > 1 else "replica"
ADAPTERS: dict[str, str] = {}
RELEASE = threading.Event()
STATE = {"held": 0, "calls": 0}
LOCK = threading.Lock()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _send(self, code: int, obj: object) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/health":
            return self._send(200, {})
        if self.path == "/_state":
            with LOCK:
                return self._send(200, {"name": NAME, "adapters": sorted(ADAPTERS), **STATE})
        self._send(404, {"error": {"message": self.path}})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        if self.path in ("/_release", "/_rearm"):
            RELEASE.set() if self.path == "/_release" else RELEASE.clear()
            return self._send(200, {})
        if self.path == "/v1/load_lora_adapter":
            if body["lora_name"] in ADAPTERS and not body.get("load_inplace"):
                return self._send(400, {"error": {"message": "already loaded"}})
            ADAPTERS[body["lora_name"]] = body["lora_path"]
            return self._send(200, {})
        if self.path == "/v1/unload_lora_adapter":
            if ADAPTERS.pop(body["lora_name"], None) is None:
                return self._send(404, {"error": {"message": "not loaded"}})
            return self._send(200, {})
        if self.path == "/v1/chat/completions":
            return self._chat(body)
        self._send(404, {"error": {"message": self.path}})

    def _hold(self, body: dict) -> None:
        if body.get("x_hold"):
            with LOCK:
                STATE["held"] += 1
            RELEASE.wait(60)
            with LOCK:
                STATE["held"] -= 1

    def _chat(self, body: dict) -> None:
        model = body.get("model")
        if model not in ADAPTERS and "@" in model:  # any other name is the base model
            return self._send(404, {"error": {"message": f"The model `{model}` does not exist.",
                                              "param": "model"}})
        with LOCK:
            STATE["calls"] += 1
        choice = {"index": 0, "finish_reason": "stop", "token_ids": [7, 8],
                  "message": {"role": "assistant", "content": f"{NAME}:{model}"},
                  "logprobs": {"content": [{"token": "a", "logprob": -0.5},
                                           {"token": "b", "logprob": -0.25}]}}
        resp = {"id": "c", "object": "chat.completion", "created": 0, "model": model,
                "system_fingerprint": NAME, "prompt_token_ids": [1, 2, 3], "choices": [choice]}
        if not body.get("stream"):
            self._hold(body)
            return self._send(200, resp)
        self.send_response(200)  # chunked, as vLLM's uvicorn sends: a cut stream is detectable
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Connection", "close")
        self.end_headers()
        base = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": model,
                "system_fingerprint": NAME, "prompt_token_ids": [1, 2, 3]}
        chunks = [
            {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": "a"},
                                  "token_ids": [7], "logprobs": choice["logprobs"]["content"][:1]
                                  and {"content": choice["logprobs"]["content"][:1]}}]},
            {**base, "choices": [{"index": 0, "delta": {"content": "b"}, "token_ids": [8],
                                  "finish_reason": "stop",
                                  "logprobs": {"content": choice["logprobs"]["content"][1:]}}]},
        ]
        self._chunk(b"data: " + json.dumps(chunks[0]).encode() + b"\n\n")
        self._hold(body)
        self._chunk(b"data: " + json.dumps(chunks[1]).encode() + b"\n\ndata: [DONE]\n\n")
        self._chunk(b"")
        self.close_connection = True

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()


class _Server(ThreadingHTTPServer):
    request_queue_size = 1024
    daemon_threads = True
    allow_reuse_address = True


if __name__ == "__main__":
    server = _Server(("127.0.0.1", int(sys.argv[2]) if len(sys.argv) > 2 else 0), _Handler)
    print(server.server_address[1], flush=True)
    server.serve_forever()
