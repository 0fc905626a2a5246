"""Pure pieces of the gateway: hermes tool-call parsing, stream assembly, caller stripping."""

import json

from tracerl.backend.engines.tool_parsers import parse_hermes
from tracerl.backend.recorder import (
    StreamAssembler,
    build_call,
    inject_training_fields,
    strip_for_caller,
)


def test_hermes_tool_calls_are_parsed_and_bad_blocks_kept_as_text():
    text = (
        'Let me check.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>'
    )
    content, calls = parse_hermes(text)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "add"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    assert calls[1]["function"]["arguments"] == '{"a": 1}'
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    broken = "<tool_call>{not json}</tool_call>"
    assert parse_hermes(broken) == (broken, [])


def test_stream_assembly_rebuilds_content_tool_calls_tokens_and_logprobs():
    chunks = [
        {"id": "x", "created": 1, "model": "m", "prompt_token_ids": [1, 2],
         "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"index": 0, "delta": {"content": "Hi"}, "token_ids": [7],
                      "logprobs": {"content": [{"token": "Hi", "logprob": -0.5}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "id": "call_1", "function": {"name": "get_", "arguments": '{"ci'}}]},
            "token_ids": [8], "logprobs": {"content": [{"token": "<t>", "logprob": -0.25}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "function": {"name": "weather", "arguments": 'ty": "Oslo"}'}}]},
            "token_ids": [9], "logprobs": {"content": [{"token": "</t>", "logprob": -0.125}]},
            "finish_reason": "tool_calls"}]},
        {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 3}},
    ]
    asm = StreamAssembler()
    for c in chunks:
        asm.add(c)
    response = asm.response()
    call = build_call(
        endpoint="chat.completions",
        caller_body={"model": "m", "temperature": 0.5},
        response=response,
        rollout_id="ro-1",
        model="m",
        adapter_step=2,
        latency_s=0.1,
        streamed=True,
    )
    (comp,) = call.completions
    assert call.prompt_token_ids == [1, 2] and comp.token_ids == [7, 8, 9]
    assert comp.logprobs == [-0.5, -0.25, -0.125] and comp.text == "Hi"
    assert comp.finish_reason == "tool_calls"
    assert comp.tool_calls[0]["function"] == {
        "name": "get_weather",
        "arguments": '{"city": "Oslo"}',
    }
    assert call.temperature == 0.5 and call.streamed


def test_injected_fields_are_stripped_unless_asked():
    body = {"model": "m", "messages": []}
    sent = inject_training_fields("chat.completions", body)
    assert (
        sent["logprobs"] is True and sent["top_logprobs"] == 0 and sent["return_token_ids"] is True
    )
    assert "logprobs" not in body  # the caller's body is not modified
    response = {
        "prompt_token_ids": [1],
        "choices": [
            {
                "index": 0,
                "token_ids": [2],
                "logprobs": {"content": []},
                "message": {"role": "assistant", "content": "x"},
            }
        ],
    }
    plain = strip_for_caller("chat.completions", body, response)
    assert "prompt_token_ids" not in plain and plain["choices"][0]["logprobs"] is None
    assert "token_ids" not in plain["choices"][0]
    asked = strip_for_caller(
        "chat.completions", {**body, "logprobs": True, "return_token_ids": True}, response
    )
    assert asked == response
    # /v1/completions: logprobs=0 is a request for the sampled token's logprob
    assert strip_for_caller("completions", {"logprobs": 0}, {"choices": [{"logprobs": {"a": 1}}]})[
        "choices"][0]["logprobs"] == {"a": 1}
