"""What every protocol provides to the gateway (its routes, the engine call it is rendered on,
one :class:`Exchange` per request), and the chat stream reader they share.

A protocol module declares a :class:`Protocol` subclass; the gateway serves every protocol
that :mod:`.registry` finds (tracerl's own and those of ``tracerl_protocols`` plugins), each
route under ``/v1`` and ``/rollouts/{rollout_id}/v1``, and runs every request the same way:
``exchange = protocol.begin(body)``, the engine call with ``exchange.chat_body``,
``exchange.answer(...)`` (or ``stream_events`` ... ``final_events`` for a stream), the record,
then ``exchange.recorded()``; the answer (or the final events) is sent once the record is on
disk.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from ...core.engine import EngineRequestError


def bad(message: str, param: str, status: int = 400) -> EngineRequestError:
    """A 4xx naming the request field at fault."""
    return EngineRequestError(message, param=param, status=status)


def sse(event: str, data: dict[str, Any]) -> bytes:
    """One server-sent event with a named type (Responses and Anthropic both name theirs)."""
    return f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()


Endpoint = Literal["chat.completions", "completions"]


class Exchange(ABC):
    """One request of a protocol: its translation for the engine and the answer translated
    back. ``chat_body`` is the engine request (a chat completion request, or a completions one
    for a protocol on that endpoint); ``id`` the protocol's id for this request."""

    protocol: str
    id: str
    chat_body: dict[str, Any]
    # whether the engine's per-token logprob entries are kept for this call (its caller asked
    # for logprobs, or the protocol renders them); otherwise only the sampled tokens' values
    keeps_logprob_entries: bool = True

    @abstractmethod
    def answer(self, chat_response: dict[str, Any]) -> dict[str, Any]:
        """The protocol's answer for the engine's chat completion."""

    @abstractmethod
    def stream_events(self, chunk: dict[str, Any]) -> list[bytes]:
        """The protocol's events for one chat completion chunk (token ids still in it)."""

    @abstractmethod
    def final_events(self) -> list[bytes]:
        """The closing events, sent once the record is on disk."""

    def recorded(self) -> None:  # noqa: B027 - optional: most exchanges keep no state
        """The call's record is on disk (after ``answer`` or ``final_events``): commit what
        the protocol keeps (Responses stores the conversation for ``previous_response_id``)."""

    @abstractmethod
    def error_event(self, message: str, code: str | None = None) -> bytes:
        """The event telling the caller the stream broke off (``code``: the error's code)."""

    @property
    def metadata(self) -> dict[str, Any]:
        """What the call's record keeps of the exchange (``LLMCall.metadata``)."""
        return {"protocol": self.protocol, "id": self.id}


class Protocol(ABC):
    """An API the gateway serves: its routes and how one request of it is exchanged.

    Instantiated once per gateway (it may keep state, as Responses keeps stored responses);
    ``begin`` runs on the gateway's event loop for every request and must not block.
    """

    name: ClassVar[str]  # unique; e.g. "responses"
    routes: ClassVar[tuple[str, ...]]  # POST paths under /v1, e.g. ("/responses",)
    endpoint: ClassVar[Endpoint] = "chat.completions"  # the engine call it is rendered on
    streams: ClassVar[bool] = True  # whether ``"stream": true`` is served

    @abstractmethod
    def begin(self, body: dict[str, Any]) -> Exchange:
        """One request: its exchange, or an :class:`EngineRequestError` naming the field at
        fault (answered 4xx; nothing is recorded)."""


@dataclass
class ChatStreamReader:
    """Turns chat completion chunks (choice 0) into text and tool-call steps, and keeps totals.

    ``feed`` returns steps: ``("text", delta)``, ``("tool", index, call_id, name)`` when a tool
    call starts, ``("args", index, delta)`` for its arguments.
    """

    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: Any = None
    text: str = ""
    tool_calls: dict[int, dict[str, str]] = field(default_factory=dict)
    usage: dict[str, Any] | None = None

    def feed(self, chunk: dict[str, Any]) -> list[tuple]:
        if chunk.get("prompt_token_ids"):
            self.prompt_tokens = len(chunk["prompt_token_ids"])
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        steps: list[tuple] = []
        for c in chunk.get("choices") or []:
            if c.get("index", 0) != 0:
                continue
            self.completion_tokens += len(c.get("token_ids") or [])
            delta = c.get("delta") or {}
            if delta.get("content"):
                self.text += delta["content"]
                steps.append(("text", delta["content"]))
            for tc in delta.get("tool_calls") or []:
                index = tc.get("index", 0)
                fn = tc.get("function") or {}
                if index not in self.tool_calls:
                    self.tool_calls[index] = {"id": tc.get("id") or f"call_{index}",
                                              "name": fn.get("name") or "", "arguments": ""}
                    steps.append(("tool", index, self.tool_calls[index]["id"],
                                  self.tool_calls[index]["name"]))
                if fn.get("arguments"):
                    self.tool_calls[index]["arguments"] += fn["arguments"]
                    steps.append(("args", index, fn["arguments"]))
            if c.get("finish_reason"):
                self.finish_reason = c["finish_reason"]
                self.stop_reason = c.get("stop_reason")
        return steps

    @property
    def output_tokens(self) -> int:
        if self.usage:
            return int(self.usage.get("completion_tokens") or self.completion_tokens)
        return self.completion_tokens


def only_choice(chat_response: dict[str, Any]) -> dict[str, Any]:
    """The answer's single choice (these protocols have no ``n``)."""
    return chat_response["choices"][0]


def text_of(content: Any, param: str, kinds: tuple[str, ...]) -> str:
    """Plain text from a string or a list of text parts of the given ``kinds``."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{param} must be a string or a list of content parts", param)
    out = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in kinds:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad(f"{param}[{i}] has type {kind!r}; supported: {', '.join(kinds)}",
                      f"{param}[{i}].type")
        if not isinstance(part.get("text"), str):
            raise bad(f"{param}[{i}].text must be a string", f"{param}[{i}].text")
        out.append(part["text"])
    return "".join(out)


def function_tool(name: Any, description: Any, parameters: Any, param: str) -> dict[str, Any]:
    """A chat function tool, checked."""
    if not isinstance(name, str) or not name:
        raise bad(f"{param}.name must be a non-empty string", f"{param}.name")
    fn: dict[str, Any] = {"name": name,
                          "parameters": parameters or {"type": "object", "properties": {}}}
    if description:
        fn["description"] = description
    return {"type": "function", "function": fn}


def parse_arguments(arguments: str) -> dict[str, Any]:
    """A tool call's arguments as a JSON object ({} when the model wrote something else)."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}
