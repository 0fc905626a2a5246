"""A chat request with given prompt token ids, answered through a text completions endpoint.

vLLM's chat endpoint renders its prompt from the messages and takes no token ids; its
completions endpoint takes them. For a chat request that carries ``PROMPT_IDS`` (the gateway's
exact turns), :func:`completion_request` makes the completions request (the chat request's
sampling settings, logprobs of the sampled tokens, token ids), and :func:`chat_reply` /
:class:`ChatChunks` shape its answer or stream as the chat endpoint's, with tool calls parsed
by tracerl's own parser for the model (:mod:`.tool_parsers`). :func:`refusal` says when that
cannot give the chat endpoint's answer (a tool-call parser tracerl does not have, forced tool
choice, structured output): such a request is rendered by the chat endpoint instead.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from ...core.engine import PROMPT_IDS
from .tool_parsers import PARSERS, TOOL_CALL_OPENINGS

# chat request fields that the completions endpoint takes as they are
_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "n", "seed", "stop", "stop_token_ids",
             "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
             "ignore_eos", "min_tokens", "include_stop_str_in_output", "skip_special_tokens",
             "stream", "stream_options", "user", "priority")
_STRUCTURED = ("response_format", "structured_outputs", "guided_json", "guided_regex",
               "guided_choice", "guided_grammar")


def _parser_name(body: dict[str, Any], parser: str | None) -> str | None:
    """The tool-call parser the chat endpoint would apply to ``body``'s answer (None: none)."""
    if not body.get("tools") or body.get("tool_choice") == "none":
        return None
    return parser


def refusal(body: dict[str, Any], parser: str | None) -> str | None:
    """Why ``body`` cannot be answered from its prompt ids through completions (None: it can);
    ``parser``: the engine's tool-call parser."""
    name = _parser_name(body, parser)
    if name is not None and name not in PARSERS:
        return (f"the {name!r} tool-call parser is not one tracerl reproduces "
                f"({', '.join(sorted(PARSERS))})")
    if body.get("tools") and body.get("tool_choice") not in (None, "auto", "none"):
        return "a forced tool_choice is enforced by the chat endpoint only"
    if any(body.get(k) for k in _STRUCTURED):
        return "structured output is served by the chat endpoint only"
    if body.get("continue_final_message") or body.get("add_generation_prompt") is False:
        return "continue_final_message / add_generation_prompt render the prompt differently"
    return None


def requested_max_tokens(body: dict[str, Any]) -> Any:
    """A chat request's token limit: ``max_completion_tokens``, else ``max_tokens`` (None:
    neither)."""
    return body.get("max_completion_tokens") or body.get("max_tokens")


def completion_request(body: dict[str, Any], max_model_len: int) -> dict[str, Any]:
    """The completions request answering chat request ``body`` from ``body[PROMPT_IDS]``."""
    ids = list(body[PROMPT_IDS])
    out = {k: body[k] for k in _SAMPLING if body.get(k) is not None}
    limit = requested_max_tokens(body)
    out.update(model=body["model"], prompt=ids, return_token_ids=True,
               max_tokens=limit if limit is not None else max(max_model_len - len(ids), 1),
               logprobs=int(body.get("top_logprobs") or 0))
    return out


def _entries(logprobs: dict[str, Any] | None) -> list[dict[str, Any]]:
    """A completion's logprobs as the chat endpoint's per-token entries."""
    if not logprobs:
        return []
    tops = logprobs.get("top_logprobs") or []
    out = []
    for i, (token, value) in enumerate(zip(logprobs.get("tokens") or [],
                                           logprobs.get("token_logprobs") or [], strict=True)):
        top = tops[i] if i < len(tops) and tops[i] else {}
        out.append({"token": token, "logprob": value, "bytes": list(token.encode()),
                    "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())}
                                     for t, lp in top.items()]})
    return out


def _message(text: str, finish: str | None, parser: str | None
             ) -> tuple[dict[str, Any], str | None]:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if parser is not None:
        content, calls = PARSERS[parser](text)
        if calls:
            return {"role": "assistant", "content": content or None, "tool_calls": calls}, \
                "tool_calls"
    return message, finish


def chat_reply(body: dict[str, Any], reply: dict[str, Any], parser: str | None
               ) -> dict[str, Any]:
    """The chat completion for ``body`` from the completions endpoint's ``reply``."""
    parser = _parser_name(body, parser)
    choices = []
    for c in reply.get("choices") or []:
        message, finish = _message(c.get("text") or "", c.get("finish_reason"), parser)
        choices.append({"index": c.get("index", 0), "message": message, "finish_reason": finish,
                        "stop_reason": c.get("stop_reason"),
                        "logprobs": {"content": _entries(c.get("logprobs"))},
                        "token_ids": c.get("token_ids") or []})
    return {"id": "chatcmpl-" + uuid.uuid4().hex, "object": "chat.completion",
            "created": reply.get("created") or int(time.time()), "model": body["model"],
            "choices": choices, "usage": reply.get("usage"),
            "prompt_token_ids": list(body[PROMPT_IDS])}


def _held_back(text: str, opening: str) -> int:
    """Where the tool-call markup starts in ``text``, or may start (a partial opening at its
    end); ``len(text)`` when it cannot."""
    at = text.find(opening)
    if at >= 0:
        return at
    for k in range(min(len(opening) - 1, len(text)), 0, -1):
        if text.endswith(opening[:k]):
            return len(text) - k
    return len(text)


class ChatChunks:
    """Chat completion chunks from a completions stream: text streams as content until tool-call
    markup may start; at a choice's end its text is parsed and its tool calls sent."""

    def __init__(self, body: dict[str, Any], parser: str | None) -> None:
        self.body, self.parser = body, _parser_name(body, parser)
        self.base = {"id": "chatcmpl-" + uuid.uuid4().hex, "object": "chat.completion.chunk",
                     "created": int(time.time()), "model": body["model"]}
        self.text: dict[int, str] = {}
        self.sent: dict[int, int] = {}

    def first(self) -> dict[str, Any]:
        n = int(self.body.get("n") or 1)
        return {**self.base, "prompt_token_ids": list(self.body[PROMPT_IDS]), "choices": [
            {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
             "finish_reason": None} for i in range(n)]}

    def chunk(self, chunk: dict[str, Any]) -> dict[str, Any]:
        """The chat chunk of one completions chunk."""
        if not chunk.get("choices"):
            return {**self.base, "choices": [], "usage": chunk.get("usage")}
        choices = []
        for c in chunk["choices"]:
            index, finish = c.get("index", 0), c.get("finish_reason")
            delta = self._delta(index, c.get("text") or "", finish)
            if delta.pop("tool_calls_finish", False):
                finish = "tool_calls"
            choices.append({"index": index, "delta": delta, "finish_reason": finish,
                            "stop_reason": c.get("stop_reason"),
                            "logprobs": {"content": _entries(c.get("logprobs"))},
                            "token_ids": c.get("token_ids") or []})
        out = {**self.base, "choices": choices}
        if chunk.get("usage"):
            out["usage"] = chunk["usage"]
        return out

    def _delta(self, index: int, piece: str, finish: str | None) -> dict[str, Any]:
        if self.parser is None:
            return {"content": piece} if piece else {}
        text = self.text[index] = self.text.get(index, "") + piece
        sent = self.sent.get(index, 0)
        if finish is None:
            upto = max(_held_back(text, TOOL_CALL_OPENINGS[self.parser]), sent)
            self.sent[index] = upto
            return {"content": text[sent:upto]} if upto > sent else {}
        _, calls = PARSERS[self.parser](text)
        if not calls:
            return {"content": text[sent:]} if len(text) > sent else {}
        return {"tool_calls": [{"index": j, **tc} for j, tc in enumerate(calls)],
                "tool_calls_finish": True}
