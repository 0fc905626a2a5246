"""The gateway with the real transformers engine on SmolLM2: recording, attribution, errors."""

import asyncio

import httpx2
import pytest

import tracerl
from tests.conftest import check_streamed_call_is_recorded, make_random_lora, render_ids

MSGS = [{"role": "user", "content": "Say hi."}]


async def test_recorded_prompt_ids_equal_fresh_tokenization(tf_backend, tokenizer):
    _, model = tf_backend
    with tracerl.rollout_scope() as ro:
        r = await model.openai_client().chat.completions.create(
            model=model.name, messages=MSGS, max_tokens=6, temperature=0.8)
    (call,) = await model.fetch_calls(ro.rollout_id)
    assert call.prompt_token_ids == render_ids(tokenizer, MSGS)
    comp = call.completions[0]
    assert 1 <= len(comp.token_ids) <= 6
    assert len(comp.logprobs) == len(comp.token_ids) and all(lp <= 0 for lp in comp.logprobs)
    assert (
        tokenizer.decode(comp.token_ids, skip_special_tokens=True) == r.choices[0].message.content
    )
    assert call.adapter_step == 0 and call.temperature == 0.8 and call.rollout_id == ro.rollout_id
    assert call.request["messages"] == MSGS
    # the caller asked for neither logprobs nor token ids, so it got none
    assert r.choices[0].logprobs is None
    assert "prompt_token_ids" not in (r.model_extra or {})


async def test_caller_that_asks_gets_logprobs_and_ids(tf_backend):
    _, model = tf_backend
    r = await model.openai_client().chat.completions.create(
        model=model.name, messages=MSGS, max_tokens=3, logprobs=True,
        extra_body={"return_token_ids": True})
    assert len(r.choices[0].logprobs.content) == len(r.choices[0].model_extra["token_ids"])
    assert r.model_extra["prompt_token_ids"]


async def test_header_attribution_and_completions_endpoint(tf_backend, tokenizer):
    _, model = tf_backend
    prompt = tokenizer("The capital of France is", add_special_tokens=False)["input_ids"]
    async with httpx2.AsyncClient(base_url=model.inference_base_url, timeout=120) as http:
        r = await http.post("/completions", headers={"x-rollout-id": "ro-header-test"},
                            json={"model": model.name, "prompt": prompt, "max_tokens": 4})
    assert r.status_code == 200, r.text
    (call,) = await model.fetch_calls("ro-header-test")
    assert call.endpoint == "completions" and call.prompt_token_ids == prompt
    assert len(call.completions[0].token_ids) == len(call.completions[0].logprobs)
    assert r.json()["choices"][0].get("logprobs") is None


async def test_streamed_call_is_recorded_like_a_plain_one(tf_backend):
    await check_streamed_call_is_recorded(tf_backend[1], MSGS, max_tokens=5)


async def test_100_concurrent_rollouts_get_exactly_their_own_calls(tf_backend):
    _, model = tf_backend
    client = model.openai_client()

    async def rollout(i):
        calls = 1 + i % 2
        for k in range(calls):
            await client.chat.completions.create(
                model=model.name, messages=[{"role": "user", "content": f"rollout {i} call {k}"}],
                max_tokens=1)
        return tracerl.Trajectory(messages_and_choices=[], metadata={"i": i, "calls": calls})

    groups = await tracerl.gather_trajectory_groups(
        [tracerl.TrajectoryGroup(rollout(g * 10 + i) for i in range(10)) for g in range(10)],
        show_progress=False)
    trajs = [t for g in groups for t in g]
    assert len(trajs) == 100
    for t in trajs:
        i = t.metadata["i"]
        assert len(t.llm_calls) == t.metadata["calls"]
        for k, call in enumerate(t.llm_calls):
            assert call.rollout_id == t.rollout_id
            assert call.request["messages"][0]["content"] == f"rollout {i} call {k}"


@pytest.mark.parametrize(
    "payload, status, needle",
    [
        (b"{not json", 400, "not valid JSON"),
        (
            b'{"model": "nope", "messages": [{"role": "user", "content": "x"}]}',
            404,
            "does not exist",
        ),
        (b'{"model": "gw", "messages": []}', 400, "non-empty list"),
        (
            b'{"model": "gw@7", "messages": [{"role": "user", "content": "x"}]}',
            404,
            "not the current step",
        ),
        (b"[1, 2]", 400, "JSON object"),
    ],
)
async def test_bad_requests_get_openai_style_errors(tf_backend, payload, status, needle):
    _, model = tf_backend
    async with httpx2.AsyncClient(base_url=model.inference_base_url, timeout=120) as http:
        r = await http.post("/chat/completions", content=payload,
                            headers={"content-type": "application/json"})
    assert r.status_code == status
    err = r.json()["error"]
    assert needle in err["message"] and err["type"]


async def test_oversize_prompt_is_a_400_not_a_hang(tf_backend):
    _, model = tf_backend
    async with httpx2.AsyncClient(base_url=model.inference_base_url, timeout=30) as http:
        r = await http.post("/chat/completions", json={
            "model": model.name, "messages": [{"role": "user", "content": "word " * 400}]})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"


async def test_rollout_id_with_path_tricks_is_rejected(tf_backend):
    _, model = tf_backend
    async with httpx2.AsyncClient(base_url=model.inference_base_url, timeout=120) as http:
        r = await http.post("/chat/completions", headers={"x-rollout-id": "../../etc"},
                            json={"model": model.name, "messages": MSGS, "max_tokens": 1})
    assert r.status_code == 400 and "invalid rollout id" in r.json()["error"]["message"]


async def test_lora_swap_changes_outputs(tf_backend, smollm2_path, tmp_path):
    backend, model = tf_backend
    client = model.openai_client()

    async def greedy_logprobs():
        r = await client.chat.completions.create(model=model.get_inference_name(), messages=MSGS,
                                                 max_tokens=4, temperature=0, logprobs=True)
        return [e.logprob for e in r.choices[0].logprobs.content], r.choices[0].message.content

    before = await greedy_logprobs()
    adapter = await asyncio.to_thread(make_random_lora, smollm2_path, tmp_path / "lora")
    gw = backend.gateway
    await backend.call_on_gateway(gw.models[model.name].swap_adapter(1, adapter))
    try:
        after = await greedy_logprobs()
        with tracerl.rollout_scope() as ro:
            await client.chat.completions.create(
                model=f"{model.name}@1", messages=MSGS, max_tokens=1
            )
        (call,) = await model.fetch_calls(ro.rollout_id)
        assert call.adapter_step == 1
    finally:
        gw.models[model.name].step = 0  # back to the base model for other tests
    assert before != after
