"""A calculator task that SmolLM2-135M solves with real hermes tool calls (examples and tests).

The 135M model does not call tools from a description alone, but copies the pattern
reliably (greedy) from a few in-context examples, single and parallel calls alike. The
examples are plain OpenAI-format messages, so every framework can put them into its input.
"""

from __future__ import annotations

import json
from typing import Any

SYSTEM = "You are a calculator. Always use the add tool, then answer with the result."

ADD_TOOL = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object",
                   "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}


def _call(i: int, a: int, b: int) -> dict[str, Any]:
    return {"id": f"ex{i}", "type": "function",
            "function": {"name": "add", "arguments": json.dumps({"a": a, "b": b})}}


def _single(i: int, a: int, b: int) -> list[dict[str, Any]]:
    return [{"role": "user", "content": f"What is {a} plus {b}?"},
            {"role": "assistant", "content": "", "tool_calls": [_call(i, a, b)]},
            {"role": "tool", "tool_call_id": f"ex{i}", "content": str(a + b)},
            {"role": "assistant", "content": f"The answer is {a + b}."}]


def _double(i: int, a: int, b: int, c: int, d: int) -> list[dict[str, Any]]:
    return [{"role": "user", "content": f"What is {a} plus {b} and {c} plus {d}?"},
            {"role": "assistant", "content": "",
             "tool_calls": [_call(i, a, b), _call(i + 1, c, d)]},
            {"role": "tool", "tool_call_id": f"ex{i}", "content": str(a + b)},
            {"role": "tool", "tool_call_id": f"ex{i + 1}", "content": str(c + d)},
            {"role": "assistant", "content": f"The answers are {a + b} and {c + d}."}]


def examples(parallel: bool = False) -> list[dict[str, Any]]:
    """In-context examples (without the system message)."""
    out = _single(1, 2, 5) + _single(2, 6, 1) + _single(3, 11, 4)
    if parallel:
        out += _double(4, 1, 2, 3, 3) + _double(6, 5, 4, 2, 9) + _double(8, 10, 3, 7, 7)
    return out


def question(a: int, b: int) -> dict[str, str]:
    return {"role": "user", "content": f"What is {a} plus {b}?"}


def as_response_items(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI chat messages as Agents SDK (Responses API) input items."""
    items: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            items += [{"type": "function_call", "call_id": c["id"], "name": c["function"]["name"],
                       "arguments": c["function"]["arguments"]} for c in m["tool_calls"]]
        elif m["role"] == "tool":
            items.append({"type": "function_call_output", "call_id": m["tool_call_id"],
                          "output": m["content"]})
        else:
            items.append({"role": m["role"], "content": m["content"]})
    return items


def handoff_examples(target: str) -> list[dict[str, Any]]:
    """Examples where a triage agent hands off to ``target``, which then uses the add tool."""
    out: list[dict[str, Any]] = []
    for i, (a, b) in enumerate([(2, 5), (6, 1), (11, 4)]):
        h = {"id": f"h{i}", "type": "function",
             "function": {"name": f"transfer_to_{target}", "arguments": "{}"}}
        out += [{"role": "user", "content": f"What is {a} plus {b}?"},
                {"role": "assistant", "content": "", "tool_calls": [h]},
                {"role": "tool", "tool_call_id": f"h{i}",
                 "content": json.dumps({"assistant": target})},
                {"role": "assistant", "content": "", "tool_calls": [_call(10 + i, a, b)]},
                {"role": "tool", "tool_call_id": f"ex{10 + i}", "content": str(a + b)},
                {"role": "assistant", "content": f"The answer is {a + b}."}]
    return out


def rng_sums(n: int, seed: int) -> list[tuple[int, int]]:
    """``n`` random addition problems with small operands."""
    import random

    r = random.Random(seed)
    return [(r.randint(1, 20), r.randint(1, 20)) for _ in range(n)]


def answer_reward(text: str, want: int) -> float:
    """1 for the right number in the final answer (0.2 for some number), minus a small length
    penalty, so a group of right answers still ranks (and trains) the concise ones higher."""
    import re

    numbers = [int(x) for x in re.findall(r"-?\d+", text or "")]
    correct = 1.0 if want in numbers else 0.2 if numbers else 0.0
    return correct - 0.002 * len(text or "")


def tool_model(name: str, project: str = "examples") -> Any:
    """A TrainableModel on SmolLM2 served with the tool-calling chat template."""
    import tracerl

    return tracerl.TrainableModel(
        name=name, project=project, base_model="smollm2",
        config=tracerl.ModelConfig(engine=tracerl.EngineConfig(
            max_model_len=2048, chat_template="chatml-tools", tool_call_parser="hermes")))
