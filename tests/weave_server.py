"""A recording stand-in for Weave's trace server (stdlib HTTP on loopback).

It answers the requests a ``WeaveClient`` makes when it logs calls (objects, files, calls,
feedback) and keeps them, so a test can read what Weave would have stored."""

from __future__ import annotations

import json
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class WeaveRecorder:
    def __init__(self) -> None:
        self.requests: list[tuple[str, bytes]] = []
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                recorder.requests.append((self.path, body))
                reply = recorder.reply(self.path, body)
                out = json.dumps(reply).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            do_GET = do_POST

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @staticmethod
    def reply(path: str, body: bytes) -> dict[str, Any]:
        if path.endswith("/obj/create"):
            return {"digest": uuid.uuid4().hex}
        if path.endswith("/file/create"):
            return {"digest": uuid.uuid4().hex}
        if path.endswith("/call/start"):
            start = json.loads(body)["start"]
            return {"id": start.get("id"), "trace_id": start.get("trace_id")}
        return {}

    def _json(self, suffix: str) -> list[dict[str, Any]]:
        return [json.loads(b) for p, b in self.requests if p.endswith(suffix)]

    def calls(self) -> dict[str, dict[str, Any]]:
        """Every logged call by id, start and end merged, whichever endpoints carried them."""
        out: dict[str, dict[str, Any]] = {}
        for req in self._json("/calls/complete"):
            for c in req["batch"]:
                out.setdefault(c["id"], {}).update(c)
        for req in self._json("/call/upsert_batch"):
            for item in req["batch"]:
                part = item["req"].get("start") or item["req"].get("end")
                out.setdefault(part["id"], {}).update(part)
        for req in self._json("/call/start"):
            out.setdefault(req["start"]["id"], {}).update(req["start"])
        for req in self._json("/call/end"):
            out.setdefault(req["end"]["id"], {}).update(req["end"])
        return out

    def feedback(self) -> list[dict[str, Any]]:
        items = [f for req in self._json("/feedback/batch/create") for f in req["batch"]]
        return items + self._json("/feedback/create")

    def close(self) -> None:
        self.server.shutdown()
