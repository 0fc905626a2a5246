"""Exact turns through two more stock frameworks (issue 40): an OpenAI Agents SDK ``Runner`` tool
agent and a LiteLLM SDK (``litellm.acompletion``) tool loop, each over two questions (four calls:
tool call, answer, tool call, answer), against the real gateway and SmolLM2 on the transformers
engine with the ``chatml-tools`` template. Every later call must continue the previous prompt
and completion token for token (spliced), and the rollout must train as one row.

The tool arguments hold a unicode string, a string, and nested JSON with integers, copied by
the model from the in-context examples of :mod:`tests.test_gateway_turns`.
"""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel

import tracerl
from tests.conftest import render_ids
from tests.test_gateway_turns import (
    EXAMPLES,
    SYSTEM,
    WEATHER,
    check_arguments,
    check_one_row,
    tool_arguments,
)
from tracerl.backend.chat_template import apply_chat_template_override
from tracerl.core.trajectory import LLMCall

CITIES = ("Köln", "Zürich")


class Opts(BaseModel):
    """The weather tool's nested argument (the Agents SDK's strict schemas want a model)."""

    unit: str
    days: list[int]


@pytest.fixture(scope="module")
def served_tokenizer(tokenizer):
    served = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    apply_chat_template_override(served, "chatml-tools")
    return served


def _check(calls: list[LLMCall], served_tokenizer: Any) -> None:
    """Four calls (tool call, answer, tool call, answer), the arguments as asked, one row; and
    rendered again, the history would not have continued the sampled tokens (the parser
    re-serialises the arguments), so the splice is what made it one row."""
    assert len(calls) == 4
    assert [bool(c.completions[0].tool_calls) for c in calls] == [True, False, True, False]
    for call, city in zip(calls[::2], CITIES, strict=True):
        check_arguments(tool_arguments(call), city)
    check_one_row(calls)
    for call in calls[1:]:
        assert render_ids(served_tokenizer, call.request["messages"],
                          call.request.get("tools")) != call.prompt_token_ids


@pytest.mark.parametrize("stream", [False, True])
async def test_an_agents_sdk_runner_trains_as_one_row(agent_model, served_tokenizer,
                                                      stream) -> None:
    pytest.importorskip("agents")
    from agents import Agent, ModelSettings, RunConfig, Runner, function_tool

    from examples.calculator_task import as_response_items
    from tracerl.integrations.openai_agents import TracerlModelProvider

    @function_tool
    def weather(city: str, opts: Opts) -> str:
        """Weather of a city"""
        return "rainy"

    agent = Agent(name="weather_bot", instructions=SYSTEM, tools=[weather],
                  model_settings=ModelSettings(temperature=0, max_tokens=50))
    config = RunConfig(model_provider=TracerlModelProvider(agent_model), tracing_disabled=True)
    items: list[Any] = as_response_items(EXAMPLES)
    with tracerl.rollout_scope() as ro:
        for city in CITIES:  # a second question in the same conversation, as chat UIs do
            items = [*items, {"role": "user", "content": f"What is the weather in {city}?"}]
            if stream:
                streamed = Runner.run_streamed(agent, items, run_config=config, max_turns=4)
                async for _ in streamed.stream_events():
                    pass
                items = streamed.to_input_list()
            else:
                result = await Runner.run(agent, items, run_config=config, max_turns=4)
                items = result.to_input_list()
    calls = await agent_model.fetch_calls(ro.rollout_id)
    assert all(c.streamed == stream for c in calls)
    _check(calls, served_tokenizer)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_litellm_tool_loop_trains_as_one_row(agent_model, served_tokenizer, stream) -> None:
    pytest.importorskip("litellm")
    import litellm

    from tracerl.integrations.litellm import completion_kwargs

    messages: list[Any] = [{"role": "system", "content": SYSTEM}, *EXAMPLES]
    with tracerl.rollout_scope() as ro:
        for city in CITIES:
            messages.append({"role": "user", "content": f"What is the weather in {city}?"})
            for _ in range(2):  # the tool call, then the answer
                reply = await litellm.acompletion(
                    messages=messages, tools=[WEATHER], max_tokens=50, temperature=0,
                    stream=stream, **completion_kwargs(agent_model))
                if stream:  # the chunks put together as LiteLLM's docs do
                    chunks = [chunk async for chunk in reply]
                    reply = litellm.stream_chunk_builder(chunks, messages=messages)
                message = reply.choices[0].message
                messages.append(message)  # LiteLLM's Message object, as its docs do
                if not message.tool_calls:
                    break
                for tc in message.tool_calls:
                    messages.append({"role": "tool", "tool_call_id": tc.id, "content": "rainy"})
    calls = await agent_model.fetch_calls(ro.rollout_id)
    assert all(c.streamed == stream for c in calls)
    _check(calls, served_tokenizer)
