"""Responses and Anthropic Messages on the gateway: validation, stored responses, event order,
and the record on disk before the final event, against the real gateway and SmolLM2."""

from __future__ import annotations

import json
import re

import httpx
import pytest

import tracerl
from tracerl.backend.engines.tool_parsers import content_before_tool_calls, parse_hermes
from tracerl.backend.protocols.openai import Completions
from tracerl.backend.protocols.registry import check_protocol
from tracerl.backend.protocols.responses import ResponseStore

QUESTION = "Say hello."


def rollout_url(model, rollout_id: str, path: str) -> str:
    base, _ = model.endpoint()
    return f"{base.removesuffix('/v1')}/rollouts/{rollout_id}/v1/{path}"


async def post(model, path: str, body: dict, rollout_id: str = "r-protocols") -> httpx.Response:
    async with httpx.AsyncClient(timeout=120) as client:
        return await client.post(rollout_url(model, rollout_id, path), json=body)


BAD_REQUESTS = {
    "responses-unknown-previous": ("responses", {"input": "hi", "previous_response_id": "resp_x"},
                                   404, "previous_response_id"),
    "responses-no-input": ("responses", {}, 400, "input"),
    "responses-image-part": ("responses", {"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "x"}]}]}, 400, "input[0].content[0].type"),
    "responses-unknown-item": ("responses", {"input": [{"type": "item_reference", "id": "x"}]},
                               400, "input[0].type"),
    "responses-hosted-tool": ("responses", {"input": "hi", "tools": [{"type": "web_search"}]},
                              400, "tools[0].type"),
    "responses-bad-limit": ("responses", {"input": "hi", "max_output_tokens": 0}, 400,
                            "max_output_tokens"),
    "messages-no-max-tokens": ("messages", {"messages": [{"role": "user", "content": "hi"}]},
                               400, "max_tokens"),
    "messages-bad-role": ("messages", {"max_tokens": 4, "messages": [{"role": "tool",
                                                                      "content": "x"}]},
                          400, "messages[0].role"),
    "messages-image-block": ("messages", {"max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
        "messages[0].content[0].type"),
    "messages-tool-result-without-id": ("messages", {"max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "tool_result", "content": "7"}]}]}, 400,
        "messages[0].content[0].tool_use_id"),
}


@pytest.mark.parametrize("case", BAD_REQUESTS)
async def test_bad_requests_name_the_field_and_record_nothing(tf_backend, case: str) -> None:
    _, model = tf_backend
    path, body, status, param = BAD_REQUESTS[case]
    with tracerl.rollout_scope() as ro:
        r = await post(model, path, {"model": model.name, **body}, ro.rollout_id)
    assert (r.status_code, r.json()["error"]["param"]) == (status, param)
    assert await model.fetch_calls(ro.rollout_id) == []


def test_stored_responses_are_bounded_per_model() -> None:
    store = ResponseStore(max_per_model=2)
    for i in range(3):
        store.put("a", f"r{i}", [{"role": "user", "content": str(i)}])
    store.put("b", "r0", [])
    assert store.get("a", "r0") is None and store.get("a", "r2") is not None
    assert store.get("b", "r0") == [] and store.get("b", "r1") is None


async def test_previous_response_continues_and_store_false_keeps_nothing(tf_backend) -> None:
    _, model = tf_backend
    body = {"model": model.name, "input": QUESTION, "max_output_tokens": 4, "temperature": 0}
    with tracerl.rollout_scope() as ro:
        first = (await post(model, "responses", body, ro.rollout_id)).json()
        second = await post(model, "responses", {**body, "input": "Again.",
                                                  "previous_response_id": first["id"]},
                            ro.rollout_id)
        unstored = (await post(model, "responses", {**body, "store": False}, ro.rollout_id)).json()
        missing = await post(model, "responses", {**body, "previous_response_id": unstored["id"]},
                             ro.rollout_id)
    assert second.status_code == 200 and missing.status_code == 404
    a, b, _ = await model.fetch_calls(ro.rollout_id)
    answer = a.response["choices"][0]["message"]["content"]
    assert b.request["messages"] == [{"role": "user", "content": QUESTION},
                                     {"role": "assistant", "content": answer},
                                     {"role": "user", "content": "Again."}]
    assert b.metadata["id"] == second.json()["id"] != a.metadata["id"] == first["id"]
    sent = a.prompt_token_ids + a.completions[0].token_ids
    assert b.prompt_token_ids[:len(sent)] == sent


STREAMS = {
    "chat": ("chat/completions", {"messages": [{"role": "user", "content": QUESTION}],
                                  "max_tokens": 4}, "data: [DONE]"),
    "responses": ("responses", {"input": QUESTION, "max_output_tokens": 4},
                  "event: response."),
    "messages": ("messages", {"messages": [{"role": "user", "content": QUESTION}],
                              "max_tokens": 4}, "event: message_stop"),
}


@pytest.mark.parametrize("protocol", STREAMS)
async def test_the_record_is_on_disk_before_the_final_event(tf_backend, protocol: str) -> None:
    """The final event is read, the connection held open, and the record must already exist."""
    _, model = tf_backend
    path, body, final = STREAMS[protocol]
    seen = []
    with tracerl.rollout_scope() as ro:
        async with httpx.AsyncClient(timeout=120) as client, client.stream(
                "POST", rollout_url(model, ro.rollout_id, path),
                json={"model": model.name, "stream": True, "temperature": 0, **body}) as r:
            async for line in r.aiter_lines():
                if line.startswith("event: ") or line.startswith("data: {"):
                    seen.append(line)
                last = line.startswith(final) and (protocol != "responses" or line.endswith(
                    (".completed", ".incomplete")))
                if last:
                    calls = await model.fetch_calls(ro.rollout_id)
                    break
    assert last and len(calls) == 1 and calls[0].completions[0].token_ids
    assert calls[0].metadata.get("protocol") == {"chat": None, "responses": "responses",
                                                 "messages": "anthropic.messages"}[protocol]


def _events(lines: list[str]) -> list[str]:
    return [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]


async def _stream_lines(model, path: str, body: dict) -> list[str]:
    async with httpx.AsyncClient(timeout=120) as client, client.stream(
            "POST", rollout_url(model, "r-events", path),
            json={"model": model.name, "stream": True, "temperature": 0, **body}) as r:
        return [line async for line in r.aiter_lines() if line]


async def test_responses_text_stream_events_are_in_the_spec_order(tf_backend) -> None:
    _, model = tf_backend
    lines = await _stream_lines(model, "responses", {"input": QUESTION, "max_output_tokens": 4})
    kinds = _events(lines)
    head = ["response.created", "response.in_progress", "response.output_item.added",
            "response.content_part.added"]
    tail = ["response.output_text.done", "response.content_part.done",
            "response.output_item.done", "response.incomplete"]
    assert kinds[:4] == head and kinds[-4:] == tail
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    datas = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert [d["sequence_number"] for d in datas] == list(range(len(datas)))
    text = "".join(d["delta"] for d in datas if d["type"] == "response.output_text.delta")
    assert datas[-1]["response"]["output"][0]["content"][0]["text"] == text


async def test_messages_text_stream_events_are_in_the_spec_order(tf_backend) -> None:
    _, model = tf_backend
    lines = await _stream_lines(model, "messages", {
        "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 4})
    kinds = _events(lines)
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    delta = json.loads(next(line for line in lines if '"message_delta"' in line)[6:])
    assert delta["delta"]["stop_reason"] == "max_tokens" and delta["usage"]["output_tokens"] == 4


TOOL_TEXTS = [
    'Let me check.<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>',
    '\n<tool_call>{"name": "f", "arguments": {}}</tool_call> and then <tool_call>'
    '{"name": "g", "arguments": {}}</tool_call> done',
    '<tool_call>{"name": "f", "arguments": {}}</tool_call>',
]


@pytest.mark.parametrize("text", TOOL_TEXTS)
def test_tool_call_turns_stream_their_content_without_markup(text: str) -> None:
    content, calls = parse_hermes(text)
    assert calls
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]  # tokens of three characters
    deltas = content_before_tool_calls(pieces, content)
    assert len(deltas) == len(pieces) and "".join(deltas) == content
    assert not any("<" in d for d in deltas)


class _Streamless(Completions):
    name = "streamless"
    routes = ("/streamless",)


@pytest.mark.parametrize(("cls", "owner", "refused"), [
    (dict, {}, "is not a tracerl.backend.protocols.base.Protocol subclass"),
    (type("Streaming", (_Streamless,), {"streams": True}), {}, "set streams = False"),
    (_Streamless, {"/streamless": "other"}, "is also served by 'other'"),
    (type("Relative", (_Streamless,), {"routes": ("plain",)}), {}, "must start with '/'"),
], ids=["not-a-protocol", "completions-that-streams", "route-taken", "relative-route"])
def test_a_protocol_the_gateway_cannot_serve_is_refused_by_name(cls, owner, refused):
    with pytest.raises(tracerl.PluginError, match=rf"protocol 'p'.*{re.escape(refused)}"):
        check_protocol("p", cls, owner)


def test_a_servable_protocol_claims_its_routes():
    owner: dict[str, str] = {}
    assert check_protocol("p", _Streamless, owner) is _Streamless and owner == {
        "/streamless": "p"}
