"""OpenAI's chat completions (``/v1/chat/completions``) and completions (``/v1/completions``):
the engine's own request shapes, passed through; what the gateway injects for training
(logprobs, token ids) is removed again from the answer unless the caller asked for it
(:func:`~tracerl.backend.protocols.replies.strip_for_caller`)."""

from __future__ import annotations

import json
from typing import Any

from .base import Endpoint, Exchange, Protocol
from .replies import caller_wants_logprobs, strip_for_caller

DONE = b"data: [DONE]\n\n"


class PassThrough(Exchange):
    """A request in the engine's own shape: answered with the engine's reply, stripped."""

    def __init__(self, endpoint: Endpoint, body: dict[str, Any]) -> None:
        self.endpoint, self.chat_body = endpoint, body
        self.protocol, self.id = endpoint, ""
        self.keeps_logprob_entries = caller_wants_logprobs(endpoint, body)

    def answer(self, chat_response: dict[str, Any]) -> dict[str, Any]:
        return strip_for_caller(self.endpoint, self.chat_body, chat_response)

    def stream_events(self, chunk: dict[str, Any]) -> list[bytes]:
        payload = strip_for_caller(self.endpoint, self.chat_body, chunk)
        return [b"data: " + json.dumps(payload).encode() + b"\n\n"]

    def final_events(self) -> list[bytes]:
        return [DONE]

    def error_event(self, message: str, code: str | None = None) -> bytes:
        payload = {"error": {"message": message, "type": "service_unavailable", "param": None,
                             "code": code}}
        return b"data: " + json.dumps(payload).encode() + b"\n\n"

    @property
    def metadata(self) -> dict[str, Any]:
        return {}  # the engine's own request: the record says it all


class ChatCompletions(Protocol):
    """``/v1/chat/completions``, streamed or not."""

    name = "chat.completions"
    routes = ("/chat/completions",)

    def begin(self, body: dict[str, Any]) -> Exchange:
        return PassThrough(self.endpoint, body)


class Completions(Protocol):
    """``/v1/completions`` (a prompt string or token ids), not streamed."""

    name = "completions"
    routes = ("/completions",)
    endpoint = "completions"
    streams = False

    def begin(self, body: dict[str, Any]) -> Exchange:
        return PassThrough(self.endpoint, body)
