"""OpenAI Responses (``/v1/responses``), rendered on the chat path.

Input items (strings; messages with ``input_text``/``output_text`` parts; ``function_call`` and
``function_call_output`` items), ``instructions``, function tools, ``tool_choice``,
``max_output_tokens`` and ``previous_response_id`` become one chat completion request; the
engine's answer becomes a ``response`` object (a ``message`` item, ``function_call`` items) or its
streaming events (``response.created`` ... ``response.completed``).

Why not vLLM's own ``/v1/responses``: the record must be the token-exact chat record the trainer
already consumes (prompt ids from the same chat template the trainer renders, completion ids,
sampled logprobs). vLLM's route returns no token ids, keeps stored responses inside the vLLM
process (gone at each restart or adapter swap) and the transformers engine has no such route.
Rendering on the chat path gives both engines one record format, one template, one store.

Stored responses (``store``, default true) are kept per model, at most ``MAX_STORED`` each
(least recently used dropped): their chat messages, so a ``previous_response_id`` continues the
exact conversation the model saw, the engine's own assistant turn included.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict
from typing import Any

from ...core.model_name import ModelName
from . import base
from .base import ChatStreamReader, Exchange, bad, function_tool, only_choice, sse, text_of

MAX_STORED = 1024
_TEXT_PARTS = ("input_text", "output_text")
_PASSED = ("temperature", "top_p", "parallel_tool_calls", "stream", "user", "seed")


class ResponseStore:
    """Stored conversations per model, bounded, thread-safe."""

    def __init__(self, max_per_model: int = MAX_STORED) -> None:
        self.max_per_model = max_per_model
        self._by_model: dict[str, OrderedDict[str, list[dict[str, Any]]]] = {}
        self._lock = threading.Lock()

    def get(self, model: str, response_id: str) -> list[dict[str, Any]] | None:
        with self._lock:
            kept = self._by_model.get(model)
            if kept is None or response_id not in kept:
                return None
            kept.move_to_end(response_id)
            return list(kept[response_id])

    def put(self, model: str, response_id: str, messages: list[dict[str, Any]]) -> None:
        with self._lock:
            kept = self._by_model.setdefault(model, OrderedDict())
            kept[response_id] = messages
            while len(kept) > self.max_per_model:
                kept.popitem(last=False)


def _message(item: dict[str, Any], param: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise bad(f"{param}.role must be user, assistant, system or developer", f"{param}.role")
    text = text_of(item.get("content"), f"{param}.content", _TEXT_PARTS)
    return {"role": "system" if role == "developer" else role, "content": text}


def _input_messages(raw: Any) -> list[dict[str, Any]]:
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list):
        raise bad("input must be a string or a list of input items", "input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(raw):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad(f"{param} must be an object", param)
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, param))
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise bad(f"{param}.{key} must be a string", f"{param}.{key}")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # one turn: text + its calls
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad(f"{param}.call_id must be a string", f"{param}.call_id")
            output = text_of(item.get("output"), f"{param}.output", ("input_text", "output_text"))
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
        elif kind == "reasoning":
            continue  # no reasoning is generated here, and chat templates drop it
        else:
            raise bad(f"{param} has type {kind!r}; supported: message, function_call, "
                      "function_call_output", f"{param}.type")
    return messages


def _tools(raw: Any) -> list[dict[str, Any]]:
    if not isinstance(raw, list):
        raise bad("tools must be a list", "tools")
    out = []
    for i, tool in enumerate(raw):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise bad(f"tools[{i}] has type {kind!r}; only function tools are served",
                      f"tools[{i}].type")
        out.append(function_tool(tool.get("name"), tool.get("description"),
                                 tool.get("parameters"), f"tools[{i}]"))
    return out


def _tool_choice(raw: Any) -> Any:
    if raw in ("auto", "none", "required"):
        return raw
    if isinstance(raw, dict) and raw.get("type") == "function" and isinstance(raw.get("name"), str):
        return {"type": "function", "function": {"name": raw["name"]}}
    raise bad("tool_choice must be auto, none, required or {type: function, name}", "tool_choice")


class Responses(base.Protocol):
    """The protocol: stored responses, and one ``ResponsesExchange`` per request."""

    name = "responses"
    routes = ("/responses",)

    def __init__(self, store: ResponseStore | None = None) -> None:
        self.store = store or ResponseStore()

    def begin(self, body: dict[str, Any]) -> ResponsesExchange:
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise bad("you must provide a model parameter", "model")
        model_key = ModelName.parse(model).base  # stored responses: per model, any step
        history: list[dict[str, Any]] = []
        previous = body.get("previous_response_id")
        if previous is not None:
            found = self.store.get(model_key, previous) if isinstance(previous, str) else None
            if found is None:
                raise bad(f"Previous response with id {previous!r} not found (responses are kept "
                          f"per model, the latest {self.store.max_per_model}, with store=true)",
                          "previous_response_id", status=404)
            history = found
        if "input" not in body:
            raise bad("input is required", "input")
        conversation = history + _input_messages(body["input"])
        if not conversation:
            raise bad("input must contain at least one item", "input")
        chat: dict[str, Any] = {"model": model, "messages": conversation}
        instructions = body.get("instructions")
        if instructions is not None:
            if not isinstance(instructions, str):
                raise bad("instructions must be a string", "instructions")
            chat["messages"] = [{"role": "system", "content": instructions}, *conversation]
        if body.get("tools"):
            chat["tools"] = _tools(body["tools"])
        if body.get("tool_choice") is not None:
            chat["tool_choice"] = _tool_choice(body["tool_choice"])
        limit = body.get("max_output_tokens")
        if limit is not None:
            if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
                raise bad("max_output_tokens must be a positive integer", "max_output_tokens")
            chat["max_tokens"] = limit
        fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
        if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
            chat["response_format"] = {"type": "json_schema", "json_schema": {
                k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
        elif isinstance(fmt, dict) and fmt.get("type") == "json_object":
            chat["response_format"] = {"type": "json_object"}
        chat.update({k: body[k] for k in _PASSED if body.get(k) is not None})
        return ResponsesExchange(self.store, model_key, body, chat, conversation)


class ResponsesExchange(Exchange):
    protocol = "responses"

    def __init__(self, store: ResponseStore, model_key: str, body: dict[str, Any],
                 chat: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        self.store, self.model_key, self.body, self.chat_body = store, model_key, body, chat
        self.conversation = conversation
        self.id = "resp_" + uuid.uuid4().hex
        self.created = int(time.time())
        self._msg_id = "msg_" + uuid.uuid4().hex
        self._reader = ChatStreamReader()
        self._seq = 0
        self._items: list[dict[str, Any]] = []  # output items as they stream
        self._open: dict[str, Any] | None = None  # the item being streamed
        self._turn: dict[str, Any] | None = None  # the answer's turn, to store once recorded

    # --- the response object -------------------------------------------------------------

    def _response(self, status: str, output: list[dict[str, Any]], usage: dict | None,
                  finish: str | None) -> dict[str, Any]:
        b = self.body
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "model": b["model"], "output": output, "instructions": b.get("instructions"),
            "tools": b.get("tools") or [], "tool_choice": b.get("tool_choice", "auto"),
            "parallel_tool_calls": b.get("parallel_tool_calls", True),
            "temperature": b.get("temperature"), "top_p": b.get("top_p"),
            "max_output_tokens": b.get("max_output_tokens"),
            "previous_response_id": b.get("previous_response_id"), "store": self._store_on,
            "text": {"format": {"type": "text"}}, "truncation": "disabled", "metadata": {},
            "error": None, "usage": usage,
            "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
        }

    @property
    def _store_on(self) -> bool:
        return self.body.get("store") is not False

    @staticmethod
    def _usage(prompt: int, completion: int) -> dict[str, Any]:
        return {"input_tokens": prompt, "output_tokens": completion,
                "total_tokens": prompt + completion,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": 0}}

    def _message_item(self, text: str, status: str = "completed") -> dict[str, Any]:
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        return {"id": self._msg_id, "type": "message", "role": "assistant", "status": status,
                "content": content if status == "completed" else []}

    @staticmethod
    def _call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
        return {"id": "fc_" + call_id.removeprefix("call_"), "type": "function_call",
                "status": status, "call_id": call_id, "name": name, "arguments": arguments}

    def _remember(self, content: str | None, calls: list[dict[str, Any]]) -> None:
        """Keep the answer's turn, stored once the call is recorded (:meth:`recorded`)."""
        turn: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            turn["tool_calls"] = calls
        self._turn = turn

    def recorded(self) -> None:
        if self._store_on and self._turn is not None:
            self.store.put(self.model_key, self.id, [*self.conversation, self._turn])

    def answer(self, chat_response: dict[str, Any]) -> dict[str, Any]:
        choice = only_choice(chat_response)
        msg = choice["message"]
        output = []
        if msg.get("content"):
            output.append(self._message_item(msg["content"]))
        for tc in msg.get("tool_calls") or []:
            fn = tc["function"]
            output.append(self._call_item(tc["id"], fn["name"], fn["arguments"]))
        usage = chat_response.get("usage") or {}
        self._remember(msg.get("content"), msg.get("tool_calls") or [])
        finish = choice.get("finish_reason")
        return self._response("incomplete" if finish == "length" else "completed", output,
                              self._usage(usage.get("prompt_tokens", 0),
                                          usage.get("completion_tokens", 0)), finish)

    # --- streaming -----------------------------------------------------------------------

    def _event(self, kind: str, **data: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self._seq, **data}
        self._seq += 1
        return sse(kind, payload)

    def _close_open(self) -> list[bytes]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = len(self._items)
        if item["type"] == "message":
            text = self._reader.text
            done = self._message_item(text)
            part = done["content"][0]
            events = [
                self._event("response.output_text.done", item_id=item["id"], output_index=index,
                            content_index=0, text=text, logprobs=[]),
                self._event("response.content_part.done", item_id=item["id"],
                            output_index=index, content_index=0, part=part),
            ]
        else:
            done = {**item, "status": "completed"}
            events = [self._event("response.function_call_arguments.done", item_id=item["id"],
                                  output_index=index, name=item["name"],
                                  arguments=item["arguments"])]
        self._items.append(done)
        return [*events, self._event("response.output_item.done", output_index=index, item=done)]

    def stream_events(self, chunk: dict[str, Any]) -> list[bytes]:
        events = []
        if self._seq == 0:
            started = self._response("in_progress", [], None, None)
            events += [self._event("response.created", response=started),
                       self._event("response.in_progress", response=started)]
        for step in self._reader.feed(chunk):
            index = len(self._items)
            if step[0] == "text":
                if self._open is None or self._open["type"] != "message":
                    events += self._close_open()
                    index = len(self._items)
                    self._open = self._message_item("", status="in_progress")
                    events += [
                        self._event("response.output_item.added", output_index=index,
                                    item=self._open),
                        self._event("response.content_part.added", item_id=self._msg_id,
                                    output_index=index, content_index=0,
                                    part={"type": "output_text", "text": "", "annotations": []}),
                    ]
                events.append(self._event("response.output_text.delta", item_id=self._msg_id,
                                          output_index=index, content_index=0, delta=step[1],
                                          logprobs=[]))
            elif step[0] == "tool":
                events += self._close_open()
                index = len(self._items)
                self._open = self._call_item(step[2], step[3], "", status="in_progress")
                events.append(self._event("response.output_item.added", output_index=index,
                                          item=dict(self._open)))
            elif self._open is not None:  # arguments of the open call
                self._open["arguments"] += step[2]
                events.append(self._event("response.function_call_arguments.delta",
                                          item_id=self._open["id"], output_index=index,
                                          delta=step[2]))
        return events

    def final_events(self) -> list[bytes]:
        events = self._close_open()
        r = self._reader
        calls = [{"id": c["id"], "type": "function",
                  "function": {"name": c["name"], "arguments": c["arguments"]}}
                 for _, c in sorted(r.tool_calls.items())]
        self._remember(r.text or None, calls)
        usage = self._usage(r.prompt_tokens, r.output_tokens)
        status = "incomplete" if r.finish_reason == "length" else "completed"
        done = self._response(status, self._items, usage, r.finish_reason)
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        return [*events, self._event(kind, response=done)]

    def error_event(self, message: str, code: str | None = None) -> bytes:
        return self._event("error", code="server_error", message=message, param=None)

