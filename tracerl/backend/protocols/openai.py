"""OpenAI's chat completions (``/v1/chat/completions``) and completions (``/v1/completions``):
the engine's own request shapes, passed through; what the gateway injects for training
(logprobs, token ids) is removed again from the answer unless the caller asked for it."""

from __future__ import annotations

import copy
import json
from typing import Any

from .base import Endpoint, Exchange, Protocol

DONE = b"data: [DONE]\n\n"


def caller_wants_logprobs(endpoint: str, caller_body: dict[str, Any]) -> bool:
    """Whether the caller itself asked for logprobs (the gateway always asks the engine)."""
    if endpoint == "completions":  # logprobs=0 asks for the sampled token's logprob
        return caller_body.get("logprobs") is not None
    return bool(caller_body.get("logprobs"))


def strip_for_caller(
    endpoint: str, caller_body: dict[str, Any], payload: dict[str, Any]
) -> dict[str, Any]:
    """Remove what the caller did not ask for from a response or stream chunk."""
    want_ids = bool(caller_body.get("return_token_ids"))
    want_logprobs = caller_wants_logprobs(endpoint, caller_body)
    if want_logprobs and want_ids:
        return payload
    out = copy.copy(payload)
    if not want_ids:
        out.pop("prompt_token_ids", None)
    choices = []
    for c in out.get("choices") or []:
        c = dict(c)
        if not want_ids:
            c.pop("token_ids", None)
            c.pop("prompt_token_ids", None)
        if not want_logprobs and "logprobs" in c:
            c["logprobs"] = None
        choices.append(c)
    if "choices" in out:
        out["choices"] = choices
    return out


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
        return PassThrough("chat.completions", body)


class Completions(Protocol):
    """``/v1/completions`` (a prompt string or token ids), not streamed."""

    name = "completions"
    routes = ("/completions",)
    endpoint = "completions"
    streams = False

    def begin(self, body: dict[str, Any]) -> Exchange:
        return PassThrough("completions", body)
