"""Tool use: reasoning-gym's ``products`` (multiply two 2-3 digit numbers), solved by a
LangGraph/LangChain agent (``create_agent``) with a ``multiply`` tool.

SmolLM2-135M cannot multiply 3-digit numbers in its head; it can copy the tool-call pattern of
two in-context examples, but at first often with wrong arguments, a wrong final answer or extra
words around it. The task's own scorer (``score_answer``: the final answer must be the number)
gives the reward, so the agent must learn to call the tool right and answer with its result.
"""

from __future__ import annotations

import json
from typing import Any

from ..core.trajectory import Trajectory
from .base import TASKS_EXTRA, Item, Task, lora_config_for

SYSTEM = "You are a calculator. Use the multiply tool, then answer with its result only."
DIFFICULTY = {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 3}


def _example(i: int, a: int, b: int) -> list[dict[str, Any]]:
    call = {"id": f"ex{i}", "type": "function",
            "function": {"name": "multiply", "arguments": json.dumps({"a": a, "b": b})}}
    return [{"role": "user", "content": f"Solve the following multiplication: {a} * {b}. "
                                        "Give only the result as your final answer."},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"ex{i}", "content": str(a * b)},
            {"role": "assistant", "content": str(a * b)}]


EXAMPLES = _example(1, 12, 7) + _example(2, 305, 41)


def draw(seed: int, n: int) -> list[Item]:
    import reasoning_gym

    dataset = reasoning_gym.create_dataset("products", seed=seed, size=n, **DIFFICULTY)
    return [Item(key=entry["question"], data=dict(entry)) for entry in dataset]


def score(entry: dict[str, Any], answer: str) -> float:
    """reasoning-gym's own scorer for ``products``."""
    import reasoning_gym

    return float(reasoning_gym.get_score_answer_fn("products")(answer.strip(), entry))


def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


def agent_with(llm: Any) -> Any:
    """The task's agent (LangGraph ``create_agent`` with the ``multiply`` tool) on chat model
    ``llm``: tracerl's (:func:`rollout`) or any ``ChatOpenAI`` (a production service's)."""
    from langchain.agents import create_agent
    from langchain_core.tools import tool

    return create_agent(llm, tools=[tool(multiply)], system_prompt=SYSTEM)


def _agent(model: Any, step: int | None, temperature: float) -> Any:
    from ..integrations.langchain import init_chat_model

    return agent_with(init_chat_model(model, step=step, temperature=temperature, max_tokens=40))


def _arguments(call: dict[str, Any]) -> tuple[int, int] | None:
    """A call's (a, b) when it names ``multiply`` with two integers, else None."""
    fn = call.get("function", call)
    args = fn.get("arguments", fn.get("args"))
    try:
        parsed = json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError:
        return None
    if fn.get("name") != "multiply" or not isinstance(parsed, dict):
        return None
    a, b = parsed.get("a"), parsed.get("b")
    return (a, b) if type(a) is int and type(b) is int else None


def tool_metrics(messages: list[dict[str, Any]], operands: tuple[int, ...] = ()
                 ) -> dict[str, float]:
    """Turns (assistant messages), tool calls, the share of tool calls that named the tool
    and gave two integers, and whether one gave the question's ``operands``."""
    calls = [c for m in messages if m.get("role") == "assistant"
             for c in m.get("tool_calls") or []]
    parsed = [_arguments(c) for c in calls]
    valid = [p for p in parsed if p is not None]
    turns = sum(1 for m in messages if m.get("role") == "assistant")
    return {"turns": float(turns), "tool_calls": float(len(calls)),
            "tool_call_valid": len(valid) / len(calls) if calls else 0.0,
            "right_arguments": float(any(sorted(p) == sorted(operands) for p in valid))}


def operands(entry: dict[str, Any]) -> tuple[int, ...]:
    """The numbers of the question (reasoning-gym's ``metadata.expression``)."""
    return tuple(int(x) for x in entry["metadata"]["expression"].split(" * "))


def shaped_reward(score: float, metrics: dict[str, float]) -> float:
    """1 for the scorer's full marks (the number alone); below it, partial credit on the way
    there, so that a group of failures still ranks its rollouts: half the scorer's partial
    score (the number inside other words), 0.2 for a well-formed tool call, 0.2 more for the
    question's numbers in it."""
    if score >= 1.0:
        return 1.0
    return 0.5 * score + 0.2 * (metrics["tool_call_valid"] > 0) + 0.2 * metrics["right_arguments"]


async def play(agent: Any, item: Item, config: dict[str, Any] | None = None
               ) -> tuple[list[dict[str, Any]], float, dict[str, float]]:
    """One episode of ``agent`` (:func:`agent_with`) on ``item``: its messages (the in-context
    examples left out once it finished), its reward and metrics (``success``: the scorer's full
    marks). ``config`` goes to ``ainvoke`` too (callbacks ...)."""
    from langchain_core.messages import convert_to_openai_messages
    from langgraph.errors import GraphRecursionError

    question = {"role": "user", "content": item.data["question"]}
    try:
        state = await agent.ainvoke({"messages": [*EXAMPLES, question]},
                                    config={**(config or {}), "recursion_limit": 7})
        messages = convert_to_openai_messages(state["messages"])
        answer = messages[-1].get("content") or "" if messages else ""
        finished = 1.0
    except GraphRecursionError:  # the agent kept calling tools: a failed episode
        messages, answer, finished = [question], "", 0.0
    scored = score(item.data, answer if isinstance(answer, str) else "")
    metrics = {"success": float(scored >= 1.0), "score": scored, "finished": finished,
               **tool_metrics(messages[len(EXAMPLES):], operands(item.data))}
    return (messages[len(EXAMPLES):] if finished else messages,
            shaped_reward(scored, metrics), metrics)


async def rollout(model: Any, item: Item, *, temperature: float = 1.0,
                  step: int | None = None) -> Trajectory:
    from ..integrations.langchain import wrap_rollout

    async def episode() -> Trajectory:
        messages, reward, metrics = await play(_agent(model, step, temperature), item)
        return Trajectory(messages_and_choices=messages, reward=reward, metrics=metrics,
                          metadata={"item": item.key})

    return await wrap_rollout(model, episode)()


TASK = Task(name="tool-products", summary="multiply two numbers with a tool (LangGraph agent)",
            source="reasoning-gym 0.1.25 `products`", framework="LangGraph create_agent",
            draw=draw, rollout=rollout, model_config=lora_config_for(
                1024, chat_template="chatml-tools", tool_call_parser="hermes"),
            requires=("reasoning_gym", "langgraph", "langchain"), install=TASKS_EXTRA)
