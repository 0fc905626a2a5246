"""Pure pieces of the gateway: hermes tool-call parsing, stream assembly, caller stripping."""

import json

import pytest

from tracerl.backend.engines.tool_parsers import parse_hermes
from tracerl.backend.gateway.recorder import (
    StreamAssembler,
    build_call,
    caller_wants_logprobs,
    drop_logprob_entries,
    inject_training_fields,
    strip_for_caller,
)

TWO_CALLS = (
    'Let me check.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>'
)


def test_hermes_blocks_become_tool_calls_and_leave_the_rest_as_content():
    content, calls = parse_hermes(TWO_CALLS)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "add"]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert len({c["id"] for c in calls}) == 2


def test_hermes_object_arguments_are_serialised_and_string_arguments_kept():
    _, (weather, add) = parse_hermes(TWO_CALLS)
    assert json.loads(weather["function"]["arguments"]) == {"city": "Oslo"}
    assert add["function"]["arguments"] == '{"a": 1}'


BROKEN_BLOCKS = {
    "not-json": "<tool_call>{not json}</tool_call>",
    "no-name": '<tool_call>{"arguments": {}}</tool_call>',
    "name-not-a-string": '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
    "json-array": '<tool_call>["get_weather"]</tool_call>',
    "unclosed": '<tool_call>{"name": "get_weather", "arguments": {}}',
    "arguments-a-list": '<tool_call>{"name": "f", "arguments": [10]}</tool_call>',
    "arguments-a-string-of-a-list": ('<tool_call>{"name": "f", "arguments": "[\\"a\\", 2]"}'
                                     '</tool_call>'),
    "arguments-a-number": '<tool_call>{"name": "f", "arguments": 3}</tool_call>',
}


@pytest.mark.parametrize("text", BROKEN_BLOCKS.values(), ids=list(BROKEN_BLOCKS))
def test_a_hermes_block_that_is_not_a_call_is_kept_as_text(text):
    assert parse_hermes(text) == (text, [])


@pytest.mark.parametrize("text", [TWO_CALLS, *BROKEN_BLOCKS.values(),
                                  '<tool_call>{"name": "f", "arguments": "{not json"}</tool_call>'],
                         ids=["valid", *BROKEN_BLOCKS, "arguments-invalid-json"])
def test_every_parsed_answer_is_a_message_langchain_takes(text):
    """LangChain's OpenAI client turns each answer into an ``AIMessage`` without raising (list
    arguments raised a ValidationError that ended a stock agent's rollout); invalid JSON
    arguments become its ``invalid_tool_calls``, as OpenAI's own may."""
    from langchain_openai.chat_models.base import _convert_dict_to_message

    content, calls = parse_hermes(text)
    message = _convert_dict_to_message({"role": "assistant", "content": content,
                                        "tool_calls": calls})
    assert len(message.tool_calls) + len(message.invalid_tool_calls) == len(calls)  # type: ignore[attr-defined]


def test_a_broken_hermes_block_beside_a_valid_one_stays_in_the_content():
    broken = "<tool_call>{not json}</tool_call>"
    content, calls = parse_hermes(broken + '<tool_call>{"name": "f", "arguments": {}}</tool_call>')
    assert content == broken and [c["function"]["name"] for c in calls] == ["f"]


STREAM = [
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


def assembled(keep_entries: bool) -> dict:
    asm = StreamAssembler(keep_entries=keep_entries)
    for chunk in STREAM:
        asm.add(chunk)
    return asm.response()


@pytest.fixture(scope="module", params=[True, False], ids=["entries", "sampled-logprobs-only"])
def streamed_call(request):
    """The record built from :data:`STREAM` assembled chunk by chunk (keeping the engine's
    logprob entries, as for a caller that asked for them, or not)."""
    return build_call(endpoint="chat.completions", caller_body={"model": "m", "temperature": 0.5},
                      response=assembled(request.param), rollout_id="ro-1", model="m",
                      adapter_step=2,
                      latency_s=0.1, streamed=True)


def test_stream_assembly_keeps_the_prompt_ids_of_the_first_chunk(streamed_call):
    assert streamed_call.prompt_token_ids == [1, 2]


def test_stream_assembly_concatenates_token_ids_and_logprobs_in_order(streamed_call):
    (comp,) = streamed_call.completions
    assert comp.token_ids == [7, 8, 9]
    assert comp.logprobs == [-0.5, -0.25, -0.125]


def test_stream_assembly_joins_content_deltas(streamed_call):
    assert streamed_call.completions[0].text == "Hi"


def test_stream_assembly_joins_tool_call_fragments_and_keeps_the_finish_reason(streamed_call):
    (comp,) = streamed_call.completions
    assert comp.finish_reason == "tool_calls"
    assert [c["function"] for c in comp.tool_calls] == [
        {"name": "get_weather", "arguments": '{"city": "Oslo"}'}]


def test_a_streamed_record_carries_the_callers_temperature_step_and_stream_flag(streamed_call):
    c = streamed_call
    assert (c.temperature, c.adapter_step, c.rollout_id, c.streamed) == (0.5, 2, "ro-1", True)


def test_injected_training_fields_ask_the_engine_for_logprobs_and_ids():
    sent = inject_training_fields("chat.completions", {"model": "m", "messages": []})
    assert (sent["logprobs"], sent["top_logprobs"], sent["return_token_ids"]) == (True, 0, True)
    completions = inject_training_fields("completions", {"model": "m", "prompt": [1]})
    assert (completions["logprobs"], completions["return_token_ids"]) == (0, True)


def test_injecting_training_fields_leaves_the_callers_body_alone():
    body = {"model": "m", "messages": []}
    inject_training_fields("chat.completions", body)
    assert body == {"model": "m", "messages": []}


def engine_answer() -> dict:
    return {"prompt_token_ids": [1], "choices": [{
        "index": 0, "token_ids": [2], "logprobs": {"content": [{"token": "x", "logprob": -1.0}]},
        "message": {"role": "assistant", "content": "x"}}]}


ASKED = {
    # id: (endpoint, what the caller sent, it gets ids back, it gets logprobs back)
    "chat-nothing": ("chat.completions", {}, False, False),
    "chat-logprobs": ("chat.completions", {"logprobs": True}, False, True),
    "chat-logprobs-false": ("chat.completions", {"logprobs": False}, False, False),
    "chat-ids": ("chat.completions", {"return_token_ids": True}, True, False),
    "chat-both": ("chat.completions", {"logprobs": True, "return_token_ids": True}, True, True),
    "completions-nothing": ("completions", {}, False, False),
    # /v1/completions: logprobs=0 is a request for the sampled token's logprob
    "completions-logprobs-0": ("completions", {"logprobs": 0}, False, True),
    "completions-both": ("completions", {"logprobs": 1, "return_token_ids": True}, True, True),
}


@pytest.mark.parametrize("endpoint, asked, gets_ids, gets_logprobs", ASKED.values(),
                         ids=list(ASKED))
def test_the_caller_gets_back_exactly_the_training_fields_it_asked_for(
        endpoint, asked, gets_ids, gets_logprobs):
    answer = engine_answer()
    out = strip_for_caller(endpoint, {"model": "m", **asked}, answer)
    choice = out["choices"][0]
    assert ("prompt_token_ids" in out, "token_ids" in choice) == (gets_ids, gets_ids)
    expected_logprobs = engine_answer()["choices"][0]["logprobs"] if gets_logprobs else None
    assert choice["logprobs"] == expected_logprobs
    assert choice["message"] == {"role": "assistant", "content": "x"}  # the answer itself stays
    assert answer == engine_answer()  # not modified: the record is built from the same chunks


def engine_reply_of(tokens: int) -> dict:
    """A chat reply as vLLM gives it: an entry (a dict, two lists) per token."""
    entries = [{"token": f"t{i}", "logprob": -0.5 - i / 1000, "bytes": [116], "top_logprobs": []}
               for i in range(tokens)]
    return {"prompt_token_ids": [1, 2], "choices": [{
        "index": 0, "token_ids": list(range(10, 10 + tokens)), "finish_reason": "length",
        "logprobs": {"content": entries}, "message": {"role": "assistant", "content": "t"}}]}


def containers_in(value) -> int:
    if isinstance(value, dict):
        return 1 + sum(containers_in(v) for v in value.values())
    if isinstance(value, list):
        return 1 + sum(containers_in(v) for v in value)
    return 0


@pytest.mark.parametrize("asked", [{}, {"return_token_ids": True}], ids=["nothing", "ids"])
def test_a_reply_without_its_logprob_entries_records_and_answers_the_same(asked):
    """What the gateway does to a reply whose caller did not ask for logprobs."""
    body = {"model": "m", "messages": [], **asked}
    kept = engine_reply_of(256)
    dropped = drop_logprob_entries(engine_reply_of(256))

    def record(reply):
        return build_call(endpoint="chat.completions", caller_body=body, response=reply,
                          rollout_id="ro", model="m", adapter_step=None, latency_s=0.0,
                          streamed=False)

    assert record(dropped).completions == record(kept).completions
    assert record(dropped).completions[0].logprobs[255] == -0.755
    assert record(dropped).response == record(kept).response
    assert strip_for_caller("chat.completions", body, dropped) == strip_for_caller(
        "chat.completions", body, kept)
    assert containers_in(kept) > 3 * 256 and containers_in(dropped) < 10


def test_whether_the_caller_asked_for_logprobs():
    assert caller_wants_logprobs("chat.completions", {"logprobs": True})
    assert not caller_wants_logprobs("chat.completions", {"logprobs": False})
    assert caller_wants_logprobs("completions", {"logprobs": 0})
    assert not caller_wants_logprobs("completions", {})


def test_a_stream_assembled_without_logprob_entries_answers_a_caller_that_did_not_ask_the_same():
    body = {"model": "m"}
    assert strip_for_caller("chat.completions", body, assembled(False)) == strip_for_caller(
        "chat.completions", body, assembled(True))
