"""A judge endpoint that misbehaves on purpose (malformed JSON, wrong ids, out-of-range scores,
stalls). It stands in for a remote judge; the judge code under test is real."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

Behaviour = Callable[[dict, list[str]], str | None]  # (request, ids) -> answer text; None = stall


def ids_in(request: dict) -> list[str]:
    text = request["messages"][-1]["content"]
    return re.findall(r'<trajectory id="(t[0-9a-f]{10})">', text)


class JudgeServer:
    def __init__(self, behaviours: list[Behaviour]):
        self.behaviours = list(behaviours)  # one per request; the last repeats
        self.requests: list[dict] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append(body)
                behaviour = server.behaviours[min(len(server.requests), len(server.behaviours)) - 1]
                answer = behaviour(body, ids_in(body))
                if answer is None:  # the injected fault: a judge that stalls past the timeout
                    time.sleep(3)
                    answer = "{}"
                if answer == "HTTP400":
                    err = json.dumps(
                        {"error": {"message": "response_format is not supported"}}
                    ).encode()
                    self.send_response(400)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(err)))
                    self.end_headers()
                    self.wfile.write(err)
                    return
                data = json.dumps(
                    {
                        "id": "j",
                        "object": "chat.completion",
                        "created": 0,
                        "model": body["model"],
                        "choices": [
                            {
                                "index": 0,
                                "finish_reason": "stop",
                                "message": {"role": "assistant", "content": answer},
                            }
                        ],
                        "usage": {
                            "prompt_tokens": 100,
                            "completion_tokens": 20,
                            "total_tokens": 120,
                        },
                    }
                ).encode()
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass

        class Server(ThreadingHTTPServer):
            request_queue_size = 128
            daemon_threads = True

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def good(score_of: Callable[[str, int], float]) -> Behaviour:
    """Valid answers, listing ids in reverse order (so matching by position would be wrong)."""
    def answer(_request, ids):
        return json.dumps(
            {
                "scores": [
                    {"trajectory_id": tid, "explanation": "ok", "score": score_of(tid, k)}
                    for k, tid in reversed(list(enumerate(ids)))
                ]
            }
        )
    return answer
