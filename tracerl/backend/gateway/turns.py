"""Exact turns: a rollout's next prompt continues its previous prompt and completion, token for
token.

A multi-turn agent sends back the assistant message it got (content and tool calls as the
parser returned them); rendered again with the chat template, that message rarely gives back
the sampled tokens (tool-call JSON re-serialised, whitespace, another tokenisation), so the new
prompt would not continue the old one and each turn would train as a row of its own. The
:class:`TurnSplicer` keeps, per served model and rollout, the last recorded calls (request
messages and tools, prompt ids, completion ids, the message the caller got). When a new chat
request of the rollout holds such a call's messages, then an assistant message equal to its
completion (same text; same tool calls by name and parsed arguments, ids ignored), then new
messages, the engine is given the prompt ``previous prompt + completion + continuation``: the
continuation is the chat template's text after the assistant turn's end token (e.g. the
newline after ``<|im_end|>``), the new messages and the generation prompt, tokenized without
added special tokens. A completion that was cut (``max_tokens``, a stop string) is continued
the same way, after its sampled ids, by the template's text after its content: the turn's end
token, inserted unsampled, where the model would have had to write it. Anything else is not
spliced, and the call's record says why (:class:`Turn`, ``LLMCall.metadata["turn"]``): the agent
edited history at message i, the template renders history differently once later messages
follow, a cut completion's tool calls or a template that ends the turn with no special token,
the engine cannot take token ids.

Memory is bounded: at most ``max_rollouts`` rollouts (least recently used dropped) of
``per_rollout`` calls each, prompt and completion ids kept as 4-byte arrays.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...core.engine import PROMPT_IDS, Engine
from ...core.trajectory import LLMCall
from ..chat_template import apply_chat_template_override

log = logging.getLogger(__name__)

TURN = "turn"  # the LLMCall.metadata key of a call's verdict
MAX_ROLLOUTS = 4096
PER_ROLLOUT = 4  # calls kept per rollout (subagents and branches interleave their turns)


@dataclass(frozen=True)
class Turn:
    """A chat call's splice verdict. ``verdict``: ``first`` (nothing earlier in its rollout),
    ``spliced``, ``new_conversation`` (shares no first message with an earlier call: a
    subagent), ``history_edited`` (the agent changed message ``message``), ``template`` (the
    chat template renders history differently once later messages follow), ``truncated`` (the
    earlier completion was cut and cannot be continued: it has tool calls, or the template
    ends its text with no special token), ``unsupported`` (the engine or request cannot
    take token ids). ``prompt_ids``: the spliced prompt."""

    verdict: str
    message: int | None = None
    why: str | None = None
    prompt_ids: list[int] | None = None

    def metadata(self) -> dict[str, Any]:
        """What the call's record keeps (``LLMCall.metadata["turn"]``)."""
        out: dict[str, Any] = {"verdict": self.verdict}
        if self.message is not None:
            out["message"] = self.message
        if self.why:
            out["why"] = self.why
        return out


@dataclass(frozen=True)
class _Recorded:
    """One recorded call of a rollout, as the next turn needs it."""

    messages: list[dict[str, Any]]
    rendering: tuple[str, str]  # the tools and template kwargs, as canonical JSON
    prompt_ids: array
    completion_ids: array
    reply: dict[str, Any]  # the assistant message the caller got
    finish_reason: str | None


def _rendering(body: dict[str, Any]) -> tuple[str, str]:
    return (json.dumps(body.get("tools") or [], sort_keys=True),
            json.dumps(body.get("chat_template_kwargs") or {}, sort_keys=True))


def _text(content: Any) -> str:
    if isinstance(content, list):  # content parts: their text
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


def _arguments(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments.strip()
    return arguments


def _tool_calls(message: dict[str, Any]) -> list[tuple[str, Any]]:
    out = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or call
        out.append((fn.get("name"), _arguments(fn.get("arguments"))))
    return out


_APART = ("id", "tool_call_id", "content", "tool_calls")  # compared below, or ids: ignored


def _same(a: dict[str, Any], b: dict[str, Any], strip: bool = False) -> str | None:
    """None when two messages mean the same (tool calls by name and parsed arguments, ids
    ignored, empty fields as absent; ``strip``: text up to surrounding whitespace); else the
    field that differs."""
    for key in sorted((set(a) | set(b)) - set(_APART)):
        if (a.get(key) or None) != (b.get(key) or None):
            return key
    ta, tb = _text(a.get("content")), _text(b.get("content"))
    if (ta.strip() != tb.strip()) if strip else (ta != tb):
        return "content"
    if _tool_calls(a) != _tool_calls(b):
        return "tool_calls"
    return None


def _compare(earlier: _Recorded, body: dict[str, Any]) -> tuple[int, str] | None:
    """None when ``body`` continues ``earlier``: its messages, then its completion as an
    assistant message; else the first message that differs and how."""
    messages = body.get("messages") or []
    for i, old in enumerate(earlier.messages):
        if i >= len(messages):
            return i, f"the conversation ends before message {i} ({old.get('role')})"
        differs = _same(old, messages[i])
        if differs:
            return i, f"message {i} ({old.get('role')}) differs in its {differs}"
    k = len(earlier.messages)
    if k >= len(messages):
        return k, "the earlier completion is not sent back as an assistant message"
    differs = _same(earlier.reply, messages[k], strip=True)
    if differs:
        return k, f"the assistant message {k} differs from the completion in its {differs}"
    if _rendering(body) != earlier.rendering:
        return k, "the tools or chat template arguments changed"
    return None


class _Renderer:
    """The served model's tokenizer and chat template, for continuations (thread-safe)."""

    def __init__(self, model_path: Path, chat_template: str | None) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        apply_chat_template_override(self.tokenizer, chat_template)
        self.special = set(self.tokenizer.all_special_ids)
        self.lock = threading.Lock()

    def _text(self, messages: list[dict[str, Any]], body: dict[str, Any], prompt: bool) -> str:
        kwargs = dict(body.get("chat_template_kwargs") or {})
        if body.get("tools"):
            kwargs["tools"] = body["tools"]
        return str(self.tokenizer.apply_chat_template(messages, add_generation_prompt=prompt,
                                                      tokenize=False, **kwargs))

    def continuation(self, body: dict[str, Any], k: int, end_id: int | None) -> list[int] | Turn:
        """The token ids after assistant message ``k``'s end token ``end_id`` up to the
        generation prompt; ``end_id`` None (the completion was cut): the ids after its text,
        the turn's end first. Or the verdict saying why there are none."""
        messages = body["messages"]
        with self.lock:
            before = self._text(messages[:k], body, False)
            upto = self._text(messages[:k + 1], body, False)
            full = self._text(messages, body, True)
            if not upto.startswith(before):
                return Turn("template", k, "the template renders the messages before the "
                            "assistant message differently once it follows")
            if not full.startswith(upto):
                return Turn("template", k, "the template renders the assistant message "
                            "differently once later messages follow")
            turn = upto[len(before):]
            if end_id is None:
                return self._after_cut(turn, full[len(upto):], _text(messages[k].get("content")),
                                       k)
            end = str(self.tokenizer.decode([end_id]))
            at = turn.rfind(end)
            if at < 0:
                return Turn("template", k, f"the rendered assistant message has no {end!r}")
            text = turn[at + len(end):] + full[len(upto):]
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _after_cut(self, turn: str, later: str, content: str, k: int) -> list[int] | Turn:
        """The ids after the cut ``content`` in the rendered assistant ``turn``, then of the
        ``later`` messages' text; they must begin with a special token (the turn's end), else
        the ``truncated`` verdict."""
        at = turn.rfind(content) if content.strip() else -1
        ids = [] if at < 0 else list(self.tokenizer(turn[at + len(content):] + later,
                                                    add_special_tokens=False)["input_ids"])
        if not ids or ids[0] not in self.special:
            return Turn("truncated", k, "the earlier completion was cut and the template does "
                        "not end its text with a special token")
        return ids


class TurnSplicer:
    """Per (served model, rollout): the last recorded calls, and each new call's splice."""

    def __init__(self, max_rollouts: int = MAX_ROLLOUTS, per_rollout: int = PER_ROLLOUT) -> None:
        self.max_rollouts, self.per_rollout = max_rollouts, per_rollout
        self._calls: OrderedDict[tuple[str, str], list[_Recorded]] = OrderedDict()
        self._renderers: dict[tuple[Path, str | None], _Renderer] = {}
        self._lock = threading.Lock()

    def remember(self, model: Path, call: LLMCall) -> None:
        """Keep ``call`` (a recorded chat call of one completion) for its rollout's next turn."""
        if (call.rollout_id is None or call.error or call.endpoint != "chat.completions"
                or len(call.completions) != 1 or not call.prompt_token_ids):
            return
        comp = call.completions[0]
        reply = {"role": "assistant", "content": comp.text, "tool_calls": comp.tool_calls}
        kept = _Recorded(list(call.request.get("messages") or []), _rendering(call.request),
                         array("i", call.prompt_token_ids), array("i", comp.token_ids), reply,
                         comp.finish_reason)
        key = (str(model), call.rollout_id)
        with self._lock:
            calls = self._calls.pop(key, [])
            calls.append(kept)
            self._calls[key] = calls[-self.per_rollout:]
            while len(self._calls) > self.max_rollouts:
                self._calls.popitem(last=False)

    def forget(self, model: Path, rollout_id: str) -> None:
        """Drop a finished rollout's calls."""
        with self._lock:
            self._calls.pop((str(model), rollout_id), None)

    def _earlier(self, model: Path, rollout_id: str) -> list[_Recorded]:
        with self._lock:
            calls = self._calls.get((str(model), rollout_id))
            if calls is not None:
                self._calls.move_to_end((str(model), rollout_id))
            return list(calls or [])

    def _renderer(self, engine: Engine) -> _Renderer:
        spec = engine.spec
        key = (spec.model_path, spec.config.chat_template)
        with self._lock:
            renderer = self._renderers.get(key)
        if renderer is None:  # loaded outside the lock; two loads at once keep one
            renderer = _Renderer(spec.model_path, spec.config.chat_template)
            with self._lock:
                renderer = self._renderers.setdefault(key, renderer)
        return renderer

    async def splice(self, model: Path, engine: Engine, rollout_id: str | None,
                     body: dict[str, Any]) -> Turn | None:
        """The verdict for a chat request ``body`` of ``rollout_id`` (None: no rollout)."""
        if rollout_id is None or not body.get("messages"):
            return None
        earlier = self._earlier(model, rollout_id)
        if not earlier:
            return Turn("first")
        return await asyncio.to_thread(self._splice, engine, earlier, body)

    def _splice(self, engine: Engine, earlier: list[_Recorded], body: dict[str, Any]) -> Turn:
        closest: tuple[int, str] = (-1, "")
        for kept in reversed(earlier):  # the latest call that the request continues
            differs = _compare(kept, body)
            if differs is None:
                return self._continue(engine, kept, body)
            closest = max(closest, differs, key=lambda d: d[0])
        at, why = closest
        messages = body["messages"]
        if at == 0 and not any(_same(kept.reply, m, strip=True) is None
                               for kept in earlier for m in messages):
            return Turn("new_conversation", 0, why)  # nothing of an earlier turn: a subagent
        return Turn("history_edited", at, why)

    def _continue(self, engine: Engine, kept: _Recorded, body: dict[str, Any]) -> Turn:
        k = len(kept.messages)
        refusal = engine.prompt_ids_refusal(body)
        if refusal:
            return Turn("unsupported", k, refusal)
        try:
            renderer = self._renderer(engine)
        except Exception as e:  # no tokenizer to render with: the engine renders as before
            log.warning("exact turns are off for %s: %s", engine.spec.model_path, e)
            return Turn("unsupported", k, f"the tokenizer did not load: {e}")
        ended = (kept.finish_reason != "length" and bool(kept.completion_ids)
                 and kept.completion_ids[-1] in renderer.special)
        if not ended and (kept.reply.get("tool_calls") or not kept.completion_ids):
            return Turn("truncated", k, "the earlier completion did not end with an end-of-turn "
                        f"token (finish_reason {kept.finish_reason})")
        try:
            rest = renderer.continuation(body, k, kept.completion_ids[-1] if ended else None)
        except Exception as e:  # the template refused these messages: the engine will say so
            return Turn("template", k, f"the chat template failed: {e}")
        if isinstance(rest, Turn):
            return rest
        why = None if ended else (f"the earlier completion was cut (finish_reason "
                                  f"{kept.finish_reason}): its turn's end is inserted, unsampled")
        return Turn("spliced", k, why, [*kept.prompt_ids, *kept.completion_ids, *rest])


def given_prompt(engine_body: dict[str, Any], turn: Turn | None) -> None:
    """Hand the spliced prompt's ids to the engine in its request (no-op otherwise)."""
    if turn is not None and turn.prompt_ids is not None:
        engine_body[PROMPT_IDS] = turn.prompt_ids
