"""Engine replies in the shapes callers and records need: a stream's chunks assembled into one
reply, what the gateway injected for training (logprobs, token ids) stripped from what a caller
did not ask for, and the per-token logprob entries of such a caller reduced to the sampled
tokens' values (a dict and two lists per token, dropped as soon as a reply is decoded)."""

from __future__ import annotations

import copy
from typing import Any


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


SAMPLED_LOGPROBS = "tracerl_sampled_logprobs"


def drop_logprob_entries(response: dict[str, Any]) -> dict[str, Any]:
    """Keep only the sampled tokens' logprobs (one list of floats per choice) of a chat reply
    whose caller did not ask for logprobs: the engine's entries are a dict and two lists per
    token, and hundreds of replies holding them at once kept the cyclic garbage collector
    walking them (BENCHMARKS.md). Done as soon as the reply is decoded."""
    for choice in response.get("choices") or []:
        content = (choice.get("logprobs") or {}).get("content")
        if content is not None:
            choice["logprobs"] = sampled_only(sampled_logprobs(content))
    return response


def sampled_logprobs(entries: list[dict[str, Any]]) -> list[float]:
    """The sampled tokens' logprobs from a chat reply's per-token entries."""
    return [float(e["logprob"]) for e in entries]


def sampled_only(values: list[float]) -> dict[str, Any]:
    """A chat choice's ``logprobs`` holding only the sampled tokens' values, no entries."""
    return {"content": None, SAMPLED_LOGPROBS: values}


class StreamAssembler:
    """Rebuilds a chat completion response from its stream chunks. ``keep_entries=False`` (a
    caller that did not ask for logprobs) keeps only the sampled tokens' logprobs, not the
    engine's per-token entries (see :func:`drop_logprob_entries`)."""

    def __init__(self, keep_entries: bool = True) -> None:
        self.keep_entries = keep_entries
        self.base: dict[str, Any] = {}
        self.prompt_token_ids: list[int] = []
        self.choices: dict[int, dict[str, Any]] = {}
        self.usage: dict[str, Any] | None = None

    def add(self, chunk: dict[str, Any]) -> None:
        if not self.base:
            self.base = {k: chunk.get(k) for k in ("id", "created", "model")}
        if chunk.get("prompt_token_ids"):
            self.prompt_token_ids = list(chunk["prompt_token_ids"])
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for c in chunk.get("choices") or []:
            acc = self.choices.setdefault(
                c.get("index", 0),
                {
                    "content": [],
                    "token_ids": [],
                    "logprobs": [],
                    "tool_calls": {},
                    "finish_reason": None,
                },
            )
            delta = c.get("delta") or {}
            if delta.get("content"):
                acc["content"].append(delta["content"])
            for tc in delta.get("tool_calls") or []:
                slot = acc["tool_calls"].setdefault(tc.get("index", 0), {
                    "id": None, "type": "function", "function": {"name": "", "arguments": ""}})
                if tc.get("id"):
                    slot["id"] = tc["id"]
                fn = tc.get("function") or {}
                slot["function"]["name"] += fn.get("name") or ""
                slot["function"]["arguments"] += fn.get("arguments") or ""
            acc["token_ids"].extend(c.get("token_ids") or [])
            entries = (c.get("logprobs") or {}).get("content") or []
            if self.keep_entries:
                acc["logprobs"].extend(entries)
            else:
                acc["logprobs"].extend(sampled_logprobs(entries))
            if c.get("finish_reason"):
                acc["finish_reason"] = c["finish_reason"]

    def response(self) -> dict[str, Any]:
        choices = []
        for index, acc in sorted(self.choices.items()):
            message: dict[str, Any] = {
                "role": "assistant",
                "content": "".join(acc["content"]) or None,
            }
            if acc["tool_calls"]:
                message["tool_calls"] = [acc["tool_calls"][k] for k in sorted(acc["tool_calls"])]
            choices.append(
                {
                    "index": index,
                    "message": message,
                    "finish_reason": acc["finish_reason"],
                    "logprobs": ({"content": acc["logprobs"]} if self.keep_entries else
                                 sampled_only(acc["logprobs"])),
                    "token_ids": acc["token_ids"],
                }
            )
        return {**self.base, "object": "chat.completion", "choices": choices,
                "usage": self.usage, "prompt_token_ids": self.prompt_token_ids}
