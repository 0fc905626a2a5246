"""Engine replies in the shape records need: a stream's chunks assembled into one reply, and
the per-token logprob entries of a caller that did not ask for them reduced to the sampled
tokens' values (a dict and two lists per token, dropped as soon as a reply is decoded)."""

from __future__ import annotations

from typing import Any

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
