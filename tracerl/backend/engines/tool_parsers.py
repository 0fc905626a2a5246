"""Tool-call parsing of generated text for engines without a parser of their own.

The ``hermes`` format (Qwen2.5, Hermes, many others) is what vLLM's ``hermes`` parser reads:
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_hermes(text: str) -> tuple[str, list[dict[str, Any]]]:
    """Split ``text`` into its plain content and OpenAI-style tool calls.

    A block that is not valid JSON with a ``name`` stays in the content, as vLLM does; so does
    one whose arguments are JSON but not an object (``[10]``): OpenAI's contract is an object,
    and LangChain's ``AIMessage`` refuses anything else, which ended a stock agent's rollout
    with a ValidationError instead of a wrong answer.
    """
    calls = []
    kept = text
    for match in _HERMES.finditer(text):
        try:
            payload = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
            continue
        args = payload.get("arguments", payload.get("parameters", {}))
        if not arguments_are_an_object(args):
            continue
        calls.append({
            "id": "call_" + uuid.uuid4().hex[:24],
            "type": "function",
            "function": {"name": payload["name"],
                         "arguments": args if isinstance(args, str) else json.dumps(args)},
        })
        kept = kept.replace(match.group(0), "")
    return (kept.strip() if calls else text), calls


def arguments_are_an_object(arguments: Any) -> bool:
    """Arguments a client can take: a JSON object, or a string that is not JSON of another kind
    (invalid JSON is the client's to report, as OpenAI's own may be). vLLM's server applies the
    same rule (``vllm_plugins/hermes_tool_parser.py`` loads this module by its path)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return True
    return isinstance(arguments, dict)


def content_before_tool_calls(pieces: list[str], content: str) -> list[str]:
    """Per-token content deltas for a tool-call turn whose tokens decode to ``pieces``.

    Tokens stream the parsed ``content`` while the generated text agrees with it; once the
    markup starts they carry nothing, and the rest of ``content`` (text after or between the
    calls) goes with the last token. The deltas join to ``content`` exactly, with no markup.
    """
    out, seen, sent = [], "", 0
    for piece in pieces:
        seen += piece
        visible = seen.lstrip()
        agreed = 0
        limit = min(len(visible), len(content))
        while agreed < limit and visible[agreed] == content[agreed]:
            agreed += 1
        out.append(content[sent:agreed] if agreed > sent else "")
        sent = max(sent, agreed)
    if out:
        out[-1] += content[sent:]
    return out


PARSERS = {"hermes": parse_hermes}
TOOL_CALL_OPENINGS = {"hermes": "<tool_call>"}  # where each parser's markup starts
