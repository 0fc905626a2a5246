"""An API protocol from outside tracerl: ``POST /v1/plain`` takes ``{"model", "input"}`` and
answers ``{"id", "output"}`` (streamed: ``data: {"delta": ...}`` events, then ``data: end``)."""

import json
import uuid
from typing import Any

from tracerl.backend.protocols.base import Exchange, Protocol, bad, only_choice


class PlainExchange(Exchange):
    protocol = "plain"

    def __init__(self, chat_body: dict[str, Any]) -> None:
        self.chat_body = chat_body
        self.id = "plain-" + uuid.uuid4().hex

    def answer(self, chat_response: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.id, "output": only_choice(chat_response)["message"]["content"]}

    def stream_events(self, chunk: dict[str, Any]) -> list[bytes]:
        deltas = [c["delta"].get("content") for c in chunk.get("choices") or []]
        return [b"data: " + json.dumps({"delta": d}).encode() + b"\n\n" for d in deltas if d]

    def final_events(self) -> list[bytes]:
        return [b"data: end\n\n"]

    def error_event(self, message: str, code: str | None = None) -> bytes:
        return b"data: " + json.dumps({"error": message}).encode() + b"\n\n"


class Plain(Protocol):
    name = "plain"
    routes = ("/plain",)

    def begin(self, body: dict[str, Any]) -> PlainExchange:
        if not isinstance(body.get("input"), str):
            raise bad("input must be a string", "input")
        chat = {"model": body.get("model"), "messages": [{"role": "user",
                                                          "content": body["input"]}]}
        if body.get("stream") is not None:
            chat["stream"] = body["stream"]
        return PlainExchange(chat)
