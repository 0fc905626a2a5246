"""Exact turns: a multi-turn tool rollout's calls continue each other token for token, through
every protocol, so that the step trains one row per rollout. Against the real gateway, SmolLM2
on the transformers engine, real LangChain ``create_agent``, the Anthropic and OpenAI SDKs.

SmolLM2 copies tool calls from in-context examples (greedy). The examples write the arguments
compactly with unicode as is; the model copies that, and the hermes parser hands them back
re-serialised (``{"city": "K\\u00f6ln", ...}``): rendered again, the assistant message would
not give back the sampled tokens, which is what the splice is for.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest

import tracerl
from tests.conftest import render_ids
from tracerl.backend.chat_template import apply_chat_template_override
from tracerl.backend.gateway.turns import TURN
from tracerl.backend.training.rows import RowStats, rows_from_calls
from tracerl.core.trajectory import LLMCall

SYSTEM = "You are a weather bot. Always use the weather tool, then answer."
WEATHER = {"type": "function", "function": {
    "name": "weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "opts": {"type": "object"}},
                   "required": ["city"]}}}


def _example(i: int, city: str, opts: dict[str, Any]) -> list[dict[str, Any]]:
    args = json.dumps({"city": city, "opts": opts}, separators=(",", ":"), ensure_ascii=False)
    return [{"role": "user", "content": f"What is the weather in {city}?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": f"e{i}", "type": "function",
                 "function": {"name": "weather", "arguments": args}}]},
            {"role": "tool", "tool_call_id": f"e{i}", "content": "sunny"},
            {"role": "assistant", "content": f"It is sunny in {city}."}]


EXAMPLES = [*_example(1, "Zürich", {"unit": "c", "days": [1, 2]}),
            *_example(2, "Paris", {"unit": "f", "days": [3]}),
            *_example(3, "Oslo", {"unit": "c", "days": [5]})]


def ask(city: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM}, *EXAMPLES,
            {"role": "user", "content": f"What is the weather in {city}?"}]


def check_one_row(calls: list[LLMCall]) -> None:
    """The rollout trains as one row, with no token twice beyond 10%."""
    stats = RowStats()
    rows = rows_from_calls(calls, stats)
    assert (len(rows), stats.prefix_mismatches, stats.merged_calls) == (1, 0, len(calls) - 1)
    last = calls[-1]
    distinct = len(last.prompt_token_ids) + len(last.completions[0].token_ids)
    assert sum(len(r) for r in rows) <= 1.1 * distinct
    for before, after in itertools.pairwise(calls):
        sent = before.prompt_token_ids + before.completions[0].token_ids
        assert after.prompt_token_ids[:len(sent)] == sent
        assert after.metadata[TURN] == {"verdict": "spliced",
                                        "message": len(before.request["messages"])}
    assert calls[0].metadata[TURN] == {"verdict": "first"}


def check_arguments(args: dict[str, Any], city: str) -> None:
    """A string (``city``, unicode or not), nested JSON with a string and integers."""
    assert args["city"] == city and args["opts"]["unit"] in ("c", "f")
    assert args["opts"]["days"] and all(isinstance(d, int) for d in args["opts"]["days"])


def tool_arguments(call: LLMCall) -> dict[str, Any]:
    (tc,) = call.completions[0].tool_calls or []
    assert tc["function"]["name"] == "weather"
    return json.loads(tc["function"]["arguments"])


@pytest.fixture(scope="module")
def served_tokenizer(tokenizer):
    served = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    apply_chat_template_override(served, "chatml-tools")
    return served


async def _chat_loop(model, city: str, stream: bool) -> list[LLMCall]:
    """A plain OpenAI-client tool loop: the reply's message goes back as the SDK parsed it."""
    client = model.openai_client()
    messages = ask(city)
    with tracerl.rollout_scope() as ro:
        for _ in range(2):
            kwargs = {"model": model.name, "messages": messages, "tools": [WEATHER],
                      "max_tokens": 50, "temperature": 0}
            if stream:
                chunks = await client.chat.completions.create(stream=True, **kwargs)
                text, calls = "", {}
                async for chunk in chunks:
                    for c in chunk.choices:
                        text += c.delta.content or ""
                        for tc in c.delta.tool_calls or []:
                            calls.setdefault(tc.index, {"id": tc.id, "type": "function",
                                                        "function": {"name": tc.function.name,
                                                                     "arguments": ""}})
                            calls[tc.index]["function"]["arguments"] += tc.function.arguments or ""
                message = {"role": "assistant", "content": text,
                           **({"tool_calls": list(calls.values())} if calls else {})}
            else:
                reply = await client.chat.completions.create(**kwargs)
                message = reply.choices[0].message.model_dump(exclude_none=True)
            messages = [*messages, message]
            if not message.get("tool_calls"):
                break
            messages.append({"role": "tool", "tool_call_id": message["tool_calls"][0]["id"],
                             "content": "rainy"})
    return await model.fetch_calls(ro.rollout_id)


@pytest.fixture(scope="module")
async def chat_rollouts(agent_model):
    return {stream: await _chat_loop(agent_model, "Köln", stream) for stream in (False, True)}


@pytest.mark.parametrize("stream", [False, True])
async def test_a_tool_loop_trains_as_one_row(chat_rollouts, served_tokenizer, stream) -> None:
    calls = chat_rollouts[stream]
    assert len(calls) == 2 and calls[0].streamed == stream
    # strings (unicode), integers and nested JSON, re-serialised by the parser
    check_arguments(tool_arguments(calls[0]), "Köln")
    assert "K\\u00f6ln" in calls[0].completions[0].tool_calls[0]["function"]["arguments"]
    check_one_row(calls)
    # rendered again, the history would not have continued the sampled tokens
    second = calls[1]
    assert render_ids(served_tokenizer, second.request["messages"],
                      second.request["tools"]) != second.prompt_token_ids
    assert second.request["messages"][-1] == {"role": "tool", "content": "rainy",
                                              "tool_call_id": calls[0].completions[0]
                                              .tool_calls[0]["id"]}  # the caller's request


async def test_a_langchain_agent_trains_as_one_row(agent_model) -> None:
    from langchain.agents import create_agent
    from langchain_core.tools import tool

    from tracerl.integrations.langchain import graph_rollout, init_chat_model

    @tool
    def weather(city: str, opts: dict) -> str:
        """Weather of a city"""
        return "rainy"

    llm = init_chat_model(agent_model, temperature=0, max_tokens=50)
    graph = create_agent(llm, tools=[weather], system_prompt=SYSTEM)
    rollout = graph_rollout(graph, lambda graph_input, state: 1.0)
    trajectory = await rollout({"messages": [*EXAMPLES, ask("Lyon")[-1]]})
    calls = trajectory.llm_calls
    assert len(calls) == 2
    check_arguments(tool_arguments(calls[0]), "Lyon")
    check_one_row(calls)


async def test_anthropic_messages_tool_use_trains_as_one_row(agent_model) -> None:
    import anthropic

    base, key = agent_model.endpoint()
    tool = {"name": "weather", "description": "Weather of a city",
            "input_schema": WEATHER["function"]["parameters"]}
    messages: list[dict[str, Any]] = []
    for m in ask("Köln")[1:]:  # the examples as Anthropic content blocks
        if m["role"] == "assistant" and m.get("tool_calls"):
            fn = m["tool_calls"][0]["function"]
            messages.append({"role": "assistant", "content": [
                {"type": "tool_use", "id": m["tool_calls"][0]["id"], "name": fn["name"],
                 "input": json.loads(fn["arguments"])}]})
        elif m["role"] == "tool":
            messages.append({"role": "user", "content": [{
                "type": "tool_result", "tool_use_id": m["tool_call_id"], "content": m["content"]}]})
        else:
            messages.append({"role": m["role"], "content": m["content"]})
    with tracerl.rollout_scope() as ro:
        client = anthropic.AsyncAnthropic(
            base_url=f"{base.removesuffix('/v1')}/rollouts/{ro.rollout_id}", api_key=key)
        first = await client.messages.create(model=agent_model.name, system=SYSTEM,
                                             messages=messages, tools=[tool], max_tokens=50,
                                             extra_body={"temperature": 0})
        (use,) = [b for b in first.content if b.type == "tool_use"]
        messages += [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                   "content": "rainy"}]}]
        await client.messages.create(model=agent_model.name, system=SYSTEM, messages=messages,
                                     tools=[tool], max_tokens=30,
                                     extra_body={"temperature": 0})
    calls = await agent_model.fetch_calls(ro.rollout_id)
    check_arguments(use.input, "Köln")
    check_one_row(calls)


async def test_responses_with_previous_response_id_train_as_one_row(agent_model) -> None:
    from examples.calculator_task import as_response_items

    client = agent_model.openai_client()
    tool = {"type": "function", **WEATHER["function"]}
    with tracerl.rollout_scope() as ro:
        first = await client.responses.create(
            model=agent_model.name, instructions=SYSTEM, input=as_response_items(ask("Oslo")[1:]),
            tools=[tool], max_output_tokens=50, temperature=0)
        (call,) = [item for item in first.output if item.type == "function_call"]
        await client.responses.create(
            model=agent_model.name, previous_response_id=first.id, tools=[tool],
            instructions=SYSTEM,  # not carried over by previous_response_id (OpenAI's rule)
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "rainy"}],
            max_output_tokens=30, temperature=0)
    calls = await agent_model.fetch_calls(ro.rollout_id)
    check_arguments(json.loads(call.arguments), "Oslo")
    check_one_row(calls)


async def test_an_agent_that_trims_history_is_reported_at_the_message_it_dropped(
        agent_model) -> None:
    client = agent_model.openai_client()
    system = {"role": "system", "content": "Answer briefly."}
    asked = [system, {"role": "user", "content": "Name a fruit."}]
    with tracerl.rollout_scope() as ro:
        for question in ("Name a colour.", "Name a city."):
            reply = await client.chat.completions.create(
                model=agent_model.name, messages=asked, max_tokens=30, temperature=0)
            answer = reply.choices[0].message.model_dump(exclude_none=True)
            # keeps the system message and the last exchange only (from the third call on)
            asked = [system, *[*asked[1:], answer][-2:], {"role": "user", "content": question}]
        await client.chat.completions.create(model=agent_model.name, messages=asked,
                                             max_tokens=30, temperature=0)
    first, second, third = await agent_model.fetch_calls(ro.rollout_id)
    assert [c.metadata[TURN]["verdict"] for c in (first, second)] == ["first", "spliced"]
    assert third.metadata[TURN]["verdict"] == "history_edited"
    assert third.metadata[TURN]["message"] == 1  # the first question is gone
    stats = RowStats()
    rows_from_calls([first, second, third], stats)
    assert (stats.merged_calls, stats.prefix_mismatches) == (1, 1)


async def test_a_cut_answer_continues_with_its_turn_end_inserted(agent_model,
                                                                 served_tokenizer) -> None:
    """An answer cut by max_tokens, sent back as the SDK gave it, is continued after its sampled
    ids: the turn's end token (not sampled) and the new messages, so the rollout is one row even
    where the text, tokenized again, would not give back the sampled ids."""
    client = agent_model.openai_client()
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Describe the sea at length."}]
    with tracerl.rollout_scope() as ro:
        for follow_up in ("Go on.", "And then?"):
            reply = await client.chat.completions.create(
                model=agent_model.name, messages=messages, max_tokens=4, temperature=0)
            assert reply.choices[0].finish_reason == "length"
            messages += [reply.choices[0].message.model_dump(exclude_none=True),
                         {"role": "user", "content": follow_up}]
    calls = await agent_model.fetch_calls(ro.rollout_id)
    end = served_tokenizer.convert_tokens_to_ids("<|im_end|>")
    for before, after in itertools.pairwise(calls):
        sent = before.prompt_token_ids + before.completions[0].token_ids
        assert after.prompt_token_ids[:len(sent) + 1] == [*sent, end]
        assert after.metadata[TURN]["verdict"] == "spliced"
        assert "cut (finish_reason length)" in after.metadata[TURN]["why"]
    stats = RowStats()
    assert len(rows_from_calls(calls, stats)) == 1 and stats.prefix_mismatches == 0
