"""Anthropic Messages (``/v1/messages``), rendered on the chat path.

``system``, content blocks (``text``, ``tool_use``, ``tool_result``), ``tools`` with
``input_schema``, ``tool_choice``, ``max_tokens`` (required) and ``stop_sequences`` become one
chat completion request; the engine's answer becomes a ``message`` (text and ``tool_use``
blocks) or its streaming events (``message_start``, ``content_block_start``/``_delta``
(``text_delta``, ``input_json_delta``)/``_stop``, ``message_delta``, ``message_stop``). The record
is the chat record, so it is token-exact and trains like any chat call.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

from .base import (
    ChatStreamReader,
    Exchange,
    Protocol,
    bad,
    function_tool,
    only_choice,
    parse_arguments,
    sse,
    text_of,
)

_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def _blocks(blocks: list[Any], param: str, texts: list[str]
            ) -> Iterator[tuple[str, str | None, dict[str, Any]]]:
    """A turn's content blocks as (field name, type, block); text blocks go to ``texts``."""
    for i, block in enumerate(blocks):
        p = f"{param}[{i}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(text_of([block], p, ("text",)))
        else:
            yield p, kind, block


def _user_turn(blocks: list[Any], param: str) -> list[dict[str, Any]]:
    """A user turn: its tool results as tool messages first, then its text."""
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for p, kind, block in _blocks(blocks, param, texts):
        if kind == "tool_result":
            if not isinstance(block.get("tool_use_id"), str):
                raise bad(f"{p}.tool_use_id must be a string", f"{p}.tool_use_id")
            content = text_of(block.get("content", ""), f"{p}.content", ("text",))
            out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": content})
        else:
            raise bad(f"{p} has type {kind!r}; supported in user turns: text, tool_result",
                      f"{p}.type")
    if texts:
        out.append({"role": "user", "content": "".join(texts)})
    return out


def _assistant_turn(blocks: list[Any], param: str) -> dict[str, Any]:
    texts: list[str] = []
    calls = []
    for p, kind, block in _blocks(blocks, param, texts):
        if kind == "tool_use":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise bad(f"{p} needs a string id and name", p)
            calls.append({"id": block["id"], "type": "function", "function": {
                "name": block["name"], "arguments": json.dumps(block.get("input") or {})}})
        elif kind in ("thinking", "redacted_thinking"):
            continue  # no thinking is generated here, and chat templates drop it
        else:
            raise bad(f"{p} has type {kind!r}; supported in assistant turns: text, tool_use",
                      f"{p}.type")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
    if calls:
        message["tool_calls"] = calls
    return message


def _messages(raw: Any) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or not raw:
        raise bad("messages must be a non-empty list", "messages")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(raw):
        param = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise bad(f"{param}.role must be user or assistant", f"{param}.role")
        content = m.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise bad(f"{param}.content must be a string or a list of blocks", f"{param}.content")
        if m["role"] == "user":
            out += _user_turn(blocks, f"{param}.content")
        else:
            out.append(_assistant_turn(blocks, f"{param}.content"))
    return out


def _tool_choice(raw: Any) -> tuple[Any, bool | None]:
    kind = raw.get("type") if isinstance(raw, dict) else None
    parallel = None if not raw.get("disable_parallel_tool_use") else False
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(raw.get("name"), str):
        return {"type": "function", "function": {"name": raw["name"]}}, parallel
    raise bad("tool_choice must be {type: auto|any|none} or {type: tool, name}", "tool_choice")


class AnthropicMessages(Protocol):
    """The protocol: one ``MessagesExchange`` per request."""

    name = "anthropic.messages"
    routes = ("/messages",)

    def begin(self, body: dict[str, Any]) -> MessagesExchange:
        max_tokens = body.get("max_tokens")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise bad("max_tokens is required and must be a positive integer", "max_tokens")
        messages = _messages(body.get("messages"))
        system = body.get("system")
        if system is not None:
            messages.insert(0, {"role": "system",
                                "content": text_of(system, "system", ("text",))})
        chat: dict[str, Any] = {"model": body.get("model"), "messages": messages,
                                "max_tokens": max_tokens}
        tools = body.get("tools")
        if tools:
            if not isinstance(tools, list):
                raise bad("tools must be a list", "tools")
            for i, t in enumerate(tools):
                if not isinstance(t, dict) or t.get("type", "custom") != "custom":
                    raise bad(f"tools[{i}] is not a client tool with an input_schema; server "
                              "tools are not served", f"tools[{i}]")
            chat["tools"] = [function_tool(t.get("name"), t.get("description"),
                                           t.get("input_schema"), f"tools[{i}]")
                             for i, t in enumerate(tools)]
        if body.get("tool_choice") is not None:
            chat["tool_choice"], parallel = _tool_choice(body["tool_choice"])
            if parallel is not None:
                chat["parallel_tool_calls"] = parallel
        stops = body.get("stop_sequences")
        if stops:
            if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
                raise bad("stop_sequences must be a list of strings", "stop_sequences")
            chat["stop"] = stops
        chat.update({k: body[k] for k in ("temperature", "top_p", "top_k", "stream")
                     if body.get(k) is not None})
        return MessagesExchange(body, chat)


class MessagesExchange(Exchange):
    protocol = "anthropic.messages"

    def __init__(self, body: dict[str, Any], chat: dict[str, Any]) -> None:
        self.body, self.chat_body = body, chat
        self.id = "msg_" + uuid.uuid4().hex
        self._reader = ChatStreamReader()
        self._started = False
        self._block: int | None = None  # index of the open content block
        self._blocks = 0
        self._text_block: int | None = None

    def _stop(self, finish: str | None, stop_reason: Any) -> tuple[str, str | None]:
        if finish == "stop" and isinstance(stop_reason, str) and \
                stop_reason in (self.body.get("stop_sequences") or []):
            return "stop_sequence", stop_reason
        return _STOP_REASONS.get(finish or "stop", "end_turn"), None

    def _message(self, content: list[dict[str, Any]], stop: tuple[str | None, str | None],
                 usage: dict[str, int]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.body["model"],
                "content": content, "stop_reason": stop[0], "stop_sequence": stop[1],
                "usage": usage}

    def answer(self, chat_response: dict[str, Any]) -> dict[str, Any]:
        choice = only_choice(chat_response)
        msg = choice["message"]
        content: list[dict[str, Any]] = []
        if msg.get("content"):
            content.append({"type": "text", "text": msg["content"]})
        for tc in msg.get("tool_calls") or []:
            content.append({"type": "tool_use", "id": tc["id"], "name": tc["function"]["name"],
                            "input": parse_arguments(tc["function"]["arguments"])})
        usage = chat_response.get("usage") or {}
        return self._message(content, self._stop(choice.get("finish_reason"),
                                                 choice.get("stop_reason")),
                             {"input_tokens": usage.get("prompt_tokens", 0),
                              "output_tokens": usage.get("completion_tokens", 0)})

    @staticmethod
    def _event(kind: str, **data: Any) -> bytes:
        return sse(kind, {"type": kind, **data})

    def _close_block(self) -> list[bytes]:
        if self._block is None:
            return []
        index, self._block = self._block, None
        return [self._event("content_block_stop", index=index)]

    def _open_block(self, block: dict[str, Any]) -> list[bytes]:
        events = self._close_block()
        self._block = self._blocks
        self._blocks += 1
        return [*events, self._event("content_block_start", index=self._block,
                                     content_block=block)]

    def stream_events(self, chunk: dict[str, Any]) -> list[bytes]:
        steps = self._reader.feed(chunk)
        events = []
        if not self._started:
            self._started = True
            usage = {"input_tokens": self._reader.prompt_tokens, "output_tokens": 0}
            events.append(self._event("message_start",
                                      message=self._message([], (None, None), usage)))
        for step in steps:
            if step[0] == "text":
                if self._block is None or self._text_block != self._block:
                    events += self._open_block({"type": "text", "text": ""})
                    self._text_block = self._block
                events.append(self._event("content_block_delta", index=self._block,
                                          delta={"type": "text_delta", "text": step[1]}))
            elif step[0] == "tool":
                events += self._open_block({"type": "tool_use", "id": step[2], "name": step[3],
                                            "input": {}})
            else:
                events.append(self._event("content_block_delta", index=self._block,
                                          delta={"type": "input_json_delta",
                                                 "partial_json": step[2]}))
        return events

    def final_events(self) -> list[bytes]:
        r = self._reader
        stop = self._stop(r.finish_reason, r.stop_reason)
        return [*self._close_block(),
                self._event("message_delta", delta={"stop_reason": stop[0],
                                                    "stop_sequence": stop[1]},
                            usage={"output_tokens": r.output_tokens}),
                self._event("message_stop")]

    def error_event(self, message: str, code: str | None = None) -> bytes:
        return self._event("error", error={"type": "api_error", "message": message})
