"""The gateway with the real transformers engine on SmolLM2: recording, attribution, errors."""

import asyncio
import uuid
from types import SimpleNamespace

import httpx2
import pytest

import tracerl
from tests.conftest import check_streamed_call_is_recorded, make_random_lora, render_ids

MSGS = [{"role": "user", "content": "Say hi."}]


def fresh_rollout_id(what: str) -> str:
    return f"ro-{what}-{uuid.uuid4().hex[:12]}"


def gateway_root(model: tracerl.TrainableModel) -> str:
    """The gateway's address without the trailing ``/v1`` (for ``/rollouts/{id}/v1/...``)."""
    base = model.inference_base_url.rstrip("/")
    assert base.endswith("/v1"), base
    return base[: -len("/v1")]


@pytest.fixture(scope="module")
async def plain_call(tf_backend):
    """One sampled chat call (T=0.8) through ``model.openai_client()``, and its record."""
    _, model = tf_backend
    with tracerl.rollout_scope() as ro:
        response = await model.openai_client().chat.completions.create(
            model=model.name, messages=MSGS, max_tokens=6, temperature=0.8)
    (call,) = await model.fetch_calls(ro.rollout_id)
    return SimpleNamespace(response=response, call=call, rollout_id=ro.rollout_id)


def test_recorded_prompt_ids_equal_a_fresh_chat_template_tokenization(plain_call, tokenizer):
    assert plain_call.call.prompt_token_ids == render_ids(tokenizer, MSGS)


def test_recorded_completion_has_one_logprob_per_sampled_token(plain_call):
    comp = plain_call.call.completions[0]
    assert 1 <= len(comp.token_ids) <= 6  # max_tokens=6
    assert len(comp.logprobs) == len(comp.token_ids)
    assert all(lp <= 0 for lp in comp.logprobs)


def test_recorded_completion_tokens_decode_to_the_answer_the_caller_got(plain_call, tokenizer):
    comp = plain_call.call.completions[0]
    text = tokenizer.decode(comp.token_ids, skip_special_tokens=True)
    assert text == plain_call.response.choices[0].message.content


def test_record_carries_rollout_step_temperature_and_the_callers_request(plain_call):
    call = plain_call.call
    assert (call.rollout_id, call.adapter_step, call.temperature) == (
        plain_call.rollout_id, 0, 0.8)
    assert call.request["messages"] == MSGS


def test_caller_that_did_not_ask_gets_neither_logprobs_nor_token_ids(plain_call):
    """The gateway injects logprobs and token ids for training and strips them again."""
    choice = plain_call.response.choices[0]
    assert choice.logprobs is None
    assert "token_ids" not in (choice.model_extra or {})
    assert "prompt_token_ids" not in (plain_call.response.model_extra or {})


async def test_caller_that_asks_gets_logprobs_and_token_ids(tf_backend, tokenizer):
    _, model = tf_backend
    r = await model.openai_client().chat.completions.create(
        model=model.name, messages=MSGS, max_tokens=3, logprobs=True,
        extra_body={"return_token_ids": True})
    token_ids = r.choices[0].model_extra["token_ids"]
    assert 1 <= len(token_ids) <= 3
    assert len(r.choices[0].logprobs.content) == len(token_ids)
    assert r.model_extra["prompt_token_ids"] == render_ids(tokenizer, MSGS)


async def test_x_rollout_id_header_attributes_a_plain_clients_call(tf_backend):
    _, model = tf_backend
    rollout_id = fresh_rollout_id("header")
    async with httpx2.AsyncClient(base_url=model.inference_base_url, timeout=120) as http:
        r = await http.post("/chat/completions", headers={"x-rollout-id": rollout_id},
                            json={"model": model.name, "messages": MSGS, "max_tokens": 1})
    assert r.status_code == 200, r.text
    (call,) = await model.fetch_calls(rollout_id)
    assert call.rollout_id == rollout_id and call.request["messages"] == MSGS


async def test_rollouts_path_prefix_attributes_a_plain_clients_call(tf_backend):
    _, model = tf_backend
    rollout_id = fresh_rollout_id("path")
    async with httpx2.AsyncClient(base_url=gateway_root(model), timeout=120) as http:
        r = await http.post(f"/rollouts/{rollout_id}/v1/chat/completions",
                            json={"model": model.name, "messages": MSGS, "max_tokens": 1})
    assert r.status_code == 200, r.text
    (call,) = await model.fetch_calls(rollout_id)
    assert call.rollout_id == rollout_id and call.request["messages"] == MSGS


async def test_completions_endpoint_records_a_token_id_prompt_exactly(tf_backend, tokenizer):
    _, model = tf_backend
    rollout_id = fresh_rollout_id("completions")
    prompt = tokenizer("The capital of France is", add_special_tokens=False)["input_ids"]
    async with httpx2.AsyncClient(base_url=model.inference_base_url, timeout=120) as http:
        r = await http.post("/completions", headers={"x-rollout-id": rollout_id},
                            json={"model": model.name, "prompt": prompt, "max_tokens": 4})
    assert r.status_code == 200, r.text
    (call,) = await model.fetch_calls(rollout_id)
    assert call.endpoint == "completions" and call.prompt_token_ids == prompt
    assert 1 <= len(call.completions[0].token_ids) <= 4
    assert len(call.completions[0].token_ids) == len(call.completions[0].logprobs)
    assert r.json()["choices"][0].get("logprobs") is None  # the caller did not ask


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
    assert sorted(t.metadata["i"] for t in trajs) == list(range(100))
    for t in trajs:
        i = t.metadata["i"]
        assert len(t.llm_calls) == t.metadata["calls"]
        for k, call in enumerate(t.llm_calls):
            assert call.rollout_id == t.rollout_id
            assert call.request["messages"][0]["content"] == f"rollout {i} call {k}"


USER_X = b'[{"role": "user", "content": "x"}]'
BAD_REQUESTS = {
    # id: (body, status, error code, words of the message)
    "not-json": (b"{not json", 400, "invalid_request", "not valid JSON"),
    "array-body": (b"[1, 2]", 400, "invalid_request", "JSON object"),
    "no-model": (b'{"messages": ' + USER_X + b"}", 400, "invalid_request",
                 "must provide a model"),
    "unknown-model": (b'{"model": "nope", "messages": ' + USER_X + b"}", 404, "model_not_found",
                      "does not exist"),
    "stale-step": (b'{"model": "gw@7", "messages": ' + USER_X + b"}", 404, "model_not_found",
                   "not the current step"),
    "bad-step": (b'{"model": "gw@x", "messages": ' + USER_X + b"}", 404, "model_not_found",
                 "bad step"),
    "empty-step": (b'{"model": "gw@", "messages": ' + USER_X + b"}", 404, "model_not_found",
                   "bad step"),
    "superscript-step": ('{"model": "gw@\u00b2", "messages": '.encode() + USER_X + b"}", 404,
                         "model_not_found", "bad step"),  # str.isdigit() says yes; int() no
    "empty-messages": (b'{"model": "gw", "messages": []}', 400, "invalid_request",
                       "non-empty list"),
    "message-without-role": (b'{"model": "gw", "messages": [{"content": "x"}]}', 400,
                             "invalid_request", "must be an object with a role"),
}


@pytest.mark.parametrize("payload, status, code, needle", BAD_REQUESTS.values(),
                         ids=list(BAD_REQUESTS))
async def test_bad_request_gets_an_openai_style_error(tf_backend, payload, status, code, needle):
    _, model = tf_backend
    async with httpx2.AsyncClient(base_url=model.inference_base_url, timeout=120) as http:
        r = await http.post("/chat/completions", content=payload,
                            headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"]
    assert (err["type"], err["code"]) == ("invalid_request_error", code)


async def test_oversize_prompt_is_a_400_not_a_hang(tf_backend):
    _, model = tf_backend
    async with httpx2.AsyncClient(base_url=model.inference_base_url, timeout=30) as http:
        r = await http.post("/chat/completions", json={
            "model": model.name, "messages": [{"role": "user", "content": "word " * 400}]})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"


BAD_ROLLOUT_IDS = {
    # id: (how the rollout id is sent, the rollout id)
    "header-parent-dirs": ("header", "../../etc"),
    "header-slash": ("header", "a/b"),
    "header-dot-dot": ("header", "a..b"),
    "header-leading-dot": ("header", ".hidden"),
    "header-space": ("header", "a b"),
    "header-empty": ("header", ""),
    "header-too-long": ("header", "x" * 129),
    "path-dot-dot": ("path", "a..b"),
    "path-leading-dot": ("path", ".hidden"),
    "path-space": ("path", "a%20b"),
    "path-too-long": ("path", "x" * 129),
}


@pytest.mark.parametrize("where, rollout_id", BAD_ROLLOUT_IDS.values(), ids=list(BAD_ROLLOUT_IDS))
async def test_rollout_id_that_could_escape_the_store_is_rejected(tf_backend, where, rollout_id):
    """Rollout ids name files of the call store: anything but a plain name is a 400."""
    _, model = tf_backend
    body = {"model": model.name, "messages": MSGS, "max_tokens": 1}
    async with httpx2.AsyncClient(base_url=gateway_root(model), timeout=120) as http:
        if where == "header":
            r = await http.post("/v1/chat/completions", headers={"x-rollout-id": rollout_id},
                                json=body)
        else:
            r = await http.post(f"/rollouts/{rollout_id}/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "invalid rollout id" in err["message"] and err["param"] == "rollout_id"


# --- a LoRA swap (last in this module: the module's swap serves step 1 until its teardown) ----

@pytest.fixture(scope="module")
async def swapped(tf_backend, smollm2_path, tmp_path_factory):
    """Greedy logprobs of the base model, then a random LoRA swapped in as step 1, then the same
    request again; the teardown routes the model back to the base for the tests after."""
    backend, model = tf_backend
    client = model.openai_client()

    async def greedy_logprobs() -> list[float]:
        r = await client.chat.completions.create(model=model.get_inference_name(), messages=MSGS,
                                                 max_tokens=4, temperature=0, logprobs=True)
        return [e.logprob for e in r.choices[0].logprobs.content]

    route = backend.gateway.models[model.spec.key]
    assert route.step == 0, "the swap tests need the base model to be served first"
    before = await greedy_logprobs()
    adapter = await asyncio.to_thread(make_random_lora, smollm2_path,
                                      tmp_path_factory.mktemp("swap") / "lora")
    await backend.call_on_gateway(route.swap_adapter(1, adapter))
    try:
        yield SimpleNamespace(model=model, before=before, after=await greedy_logprobs())
    finally:
        route.step = 0  # back to the base model for the tests after this module


def test_a_lora_swap_changes_the_served_logprobs(swapped):
    # the first token's logprob is conditioned on the same prompt before and after the swap
    assert swapped.before[0] != swapped.after[0]
    assert swapped.before != swapped.after


async def test_calls_after_a_swap_are_served_and_recorded_at_the_new_step(swapped):
    model = swapped.model
    with tracerl.rollout_scope() as ro:
        await model.openai_client().chat.completions.create(
            model=f"{model.name}@1", messages=MSGS, max_tokens=1)
    (call,) = await model.fetch_calls(ro.rollout_id)
    assert call.adapter_step == 1


async def test_a_timed_out_call_is_told_why_by_whether_it_set_max_tokens(tf_backend):
    """A 504 at the request deadline. With max_tokens set, "set max_tokens" was wrong advice
    (the online benchmark's calls had max_tokens 40 and waited on training steps): the answer
    says the engine was busy instead."""
    backend, _ = tf_backend
    model = tracerl.TrainableModel(
        name="deadline", project="tests", base_model="smollm2",
        config=tracerl.ModelConfig(engine=tracerl.EngineConfig(max_model_len=256,
                                                               request_timeout_s=0.001)))
    await model.register(backend)
    async with httpx2.AsyncClient(base_url=model.inference_base_url, timeout=60) as http:
        capped = await http.post("/chat/completions", json={
            "model": model.name, "messages": MSGS, "max_tokens": 4})
        uncapped = await http.post("/chat/completions", json={
            "model": model.name, "messages": MSGS})
    assert capped.status_code == uncapped.status_code == 504, (capped.text, uncapped.text)
    message = capped.json()["error"]["message"]
    assert "though max_tokens was 4: it was busy" in message and "set max_tokens" not in message
    assert "set max_tokens" in uncapped.json()["error"]["message"]
