"""LiteLLM adapter: the SDK callback in-process and a real LiteLLM proxy process."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import httpx2
import pytest

pytest.importorskip("litellm")

import litellm

import tracerl
from examples.calculator_task import ADD_TOOL, SYSTEM, examples, question
from tests.conftest import until
from tracerl.integrations.litellm import TracerlLiteLLMLogger, completion_kwargs
from tracerl.integrations.litellm_proxy import LiteLLMProxy

LITELLM_PYTHON = os.environ.get("TRACERL_LITELLM_PYTHON")


@pytest.fixture(scope="module")
def logger():
    # one instance: LiteLLM copies callbacks into internal lists, so a second logger would
    # keep receiving events next to the first
    lg = TracerlLiteLLMLogger()
    litellm.callbacks = [lg]
    yield lg
    litellm.logging_callback_manager.remove_callback_from_all_lists(lg)
    litellm.callbacks = []


WORDS = ["yes", "no", "maybe", "ok"]


@pytest.fixture(scope="module")
async def sdk_group(tf_backend, logger):
    """Four rollouts calling ``litellm.acompletion``, every second one streamed."""
    _, model = tf_backend

    async def rollout(word: str, stream: bool) -> tracerl.Trajectory:
        r = await litellm.acompletion(
            messages=[{"role": "user", "content": f"Say {word}"}],
            max_tokens=5,
            stream=stream,
            **completion_kwargs(model),
        )
        if stream:
            text = "".join([c.choices[0].delta.content or "" async for c in r])
        else:
            text = r.choices[0].message.content
        return tracerl.Trajectory(reward=1.0, metadata={"text": text, "word": word,
                                                        "stream": stream})

    (group,) = await tracerl.gather_trajectory_groups(
        [tracerl.TrajectoryGroup(rollout(w, stream=i % 2 == 1) for i, w in enumerate(WORDS))],
        show_progress=False,
    )
    assert group.exceptions == []
    return group


async def test_each_sdk_call_is_recorded_under_its_rollout(sdk_group):
    for traj in sdk_group.trajectories:
        (call,) = traj.llm_calls
        assert call.request["messages"][0]["content"] == f"Say {traj.metadata['word']}"


async def test_sdk_records_match_what_the_caller_received_streamed_or_not(sdk_group):
    got = [(t.llm_calls[0].streamed, t.llm_calls[0].completions[0].text)
           for t in sdk_group.trajectories]
    assert got == [(t.metadata["stream"], t.metadata["text"]) for t in sdk_group.trajectories]
    assert [streamed for streamed, _ in got] == [False, True, False, True]


async def test_each_sdk_call_has_one_finished_litellm_span_paired_with_its_record(sdk_group):
    for traj in sdk_group.trajectories:
        (span,) = traj.spans
        assert (span.framework, span.call_id) == ("litellm", traj.llm_calls[0].id)
        assert span.end_time


async def test_no_sdk_call_in_a_rollout_is_left_orphaned(sdk_group, logger):
    assert logger.recorder.orphans == []


async def test_sdk_failure_is_a_failed_span(tf_backend, logger):
    _, model = tf_backend

    async def rollout() -> tracerl.Trajectory:
        await litellm.acompletion(messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                  **completion_kwargs(model, model="hosted_vllm/no-such-model"))
        return tracerl.Trajectory(reward=0.0)

    with tracerl.rollout_scope() as ro:
        with pytest.raises(litellm.NotFoundError, match="no-such-model"):
            await rollout()
    # LiteLLM reports failures from a background task
    await until(lambda: bool(ro.spans) and ro.spans[0].error is not None,
                "LiteLLM's failure report to end the span")
    assert [s.kind for s in ro.spans] == ["llm"], [(s.name, s.error) for s in ro.spans]
    assert "no-such-model" in ro.spans[0].error


async def test_the_logger_opens_no_span_outside_rollouts(tf_backend, logger):
    from litellm.integrations.custom_logger import CustomLogger

    _, model = tf_backend
    reported = asyncio.Event()

    class Probe(CustomLogger):  # reports after the tracerl logger (callbacks run in order)
        async def async_log_success_event(self, kwargs, response_obj, start_time, end_time):
            reported.set()

    litellm.callbacks = [logger, Probe()]
    try:
        await litellm.acompletion(messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                  **completion_kwargs(model))
        await asyncio.wait_for(reported.wait(), 60)
    finally:
        litellm.callbacks = [logger]
    assert logger.recorder.orphans == [] and logger.recorder._open == {}


@pytest.fixture(scope="module")
def proxy(tf_backend, agent_model, tmp_path_factory):
    if not LITELLM_PYTHON:
        pytest.skip("TRACERL_LITELLM_PYTHON (a venv with LiteLLM's proxy) is not set")
    backend, _ = tf_backend
    with LiteLLMProxy(
        upstream_base_url=backend.base_url,
        model_names=["agent"],
        python=LITELLM_PYTHON,
        directory=tmp_path_factory.mktemp("proxy"),
    ) as p:
        yield p


def test_the_proxy_listens_on_loopback_only(proxy):
    assert proxy.host == "127.0.0.1" and proxy.base_url.startswith("http://127.0.0.1:")


def test_the_proxy_config_routes_the_model_to_the_gateway(proxy, tf_backend):
    backend, _ = tf_backend
    config = json.loads((Path(proxy.directory) / "config.yaml").read_text())  # JSON is YAML
    assert [(m["model_name"], m["litellm_params"]["model"], m["litellm_params"]["api_base"])
            for m in config["model_list"]] == [
                ("agent", "hosted_vllm/tests/agent", backend.base_url)]  # the gateway's name


def test_the_master_key_is_kept_only_in_its_own_owner_only_file(proxy):
    key_file = Path(proxy.directory) / "master_key"
    assert key_file.read_text().strip() == proxy.master_key
    assert key_file.stat().st_mode & 0o777 == 0o600
    texts = [p.read_text(errors="replace") for p in Path(proxy.directory).rglob("*")
             if p.is_file() and p != key_file]
    assert texts and not any(proxy.master_key in t for t in texts)


def test_a_restarted_proxy_keeps_its_master_key_and_a_given_one_is_not_written(tmp_path):
    first = LiteLLMProxy(upstream_base_url="http://127.0.0.1:1/v1", model_names=["m"],
                         directory=tmp_path / "run")
    again = LiteLLMProxy(upstream_base_url="http://127.0.0.1:1/v1", model_names=["m"],
                         directory=tmp_path / "run")
    assert first._persisted_master_key() == again._persisted_master_key()
    given = LiteLLMProxy(upstream_base_url="http://127.0.0.1:1/v1", model_names=["m"],
                         directory=tmp_path / "given", master_key="sk-given")
    assert given.master_key == "sk-given" and not (tmp_path / "given").exists()


# LiteLLM without a database cannot look up any key but the master key: it refuses the rest
# with 400 no_db_connection (the old check, status `in (400, 401)`, let either through)
BAD_PROXY_KEYS = {
    "none": ({}, 401, "auth_error"),
    "wrong": ({"Authorization": "Bearer wrong"}, 400, "no_db_connection"),
    "not-bearer": ({"Authorization": "wrong"}, 401, "auth_error"),
}


@pytest.mark.parametrize("case", BAD_PROXY_KEYS, ids=list(BAD_PROXY_KEYS))
async def test_the_proxy_refuses_a_request_without_the_master_key(proxy, agent_model, case):
    headers, status, error_type = BAD_PROXY_KEYS[case]
    rollout_id = f"ro-proxy-refused-{case}"
    async with httpx2.AsyncClient(base_url=proxy.base_url, timeout=120) as client:
        denied = await client.post(
            "/chat/completions",
            headers={**headers, "x-rollout-id": rollout_id},
            json={"model": "agent", "messages": [{"role": "user", "content": "hi"}]},
        )
    assert (denied.status_code, denied.json()["error"]["type"]) == (status, error_type)
    assert await agent_model.fetch_calls(rollout_id) == []  # it never reached the gateway


TOOLS = {"add": lambda a, b: a + b}
PROXY_RUNS = {"ro-proxy-a": (3, 4), "ro-proxy-b": (12, 30)}


async def http_agent(client: httpx2.AsyncClient, rollout_id: str, a: int, b: int) -> list[dict]:
    """A tool loop that speaks only HTTP (as an agent in any language would)."""
    messages = [{"role": "system", "content": SYSTEM}, *examples(), question(a, b)]
    for _ in range(3):
        r = await client.post(
            "/chat/completions",
            headers={"x-rollout-id": rollout_id},
            json={
                "model": "agent",
                "messages": messages,
                "tools": [ADD_TOOL],
                "temperature": 0,
                "max_tokens": 60,
            },
        )
        r.raise_for_status()
        message = r.json()["choices"][0]["message"]
        messages.append(
            {k: v for k, v in message.items() if k in ("role", "content", "tool_calls")}
        )
        if not message.get("tool_calls"):
            return messages
        for tc in message["tool_calls"]:
            result = TOOLS[tc["function"]["name"]](**json.loads(tc["function"]["arguments"]))
            messages.append({"role": "tool", "tool_call_id": tc["id"], "content": str(result)})
    return messages


@pytest.fixture(scope="module")
async def proxy_runs(proxy, agent_model):
    """Two concurrent HTTP agents through the proxy: rollout id -> (a, b, messages, calls)."""
    async with httpx2.AsyncClient(base_url=proxy.base_url, timeout=120,
                                 headers={"Authorization": f"Bearer {proxy.master_key}"}) as client:
        runs = await asyncio.gather(*(http_agent(client, rid, a, b)
                                      for rid, (a, b) in PROXY_RUNS.items()))
    return {rid: (a, b, messages, await agent_model.fetch_calls(rid))
            for (rid, (a, b)), messages in zip(PROXY_RUNS.items(), runs, strict=True)}


async def test_an_http_agent_gets_its_answer_through_the_proxy(proxy_runs):
    for a, b, messages, _ in proxy_runs.values():
        assert str(a + b) in messages[-1]["content"]


async def test_proxy_calls_are_recorded_under_the_rollout_header(proxy_runs):
    # the tool call and the answer, each recorded under its own rollout
    assert {rid: len(calls) for rid, (*_, calls) in proxy_runs.items()} == {
        rid: 2 for rid in PROXY_RUNS}


async def test_the_recorded_tool_call_has_the_agents_numbers(proxy_runs):
    for a, b, _, calls in proxy_runs.values():
        arguments = calls[0].completions[0].tool_calls[0]["function"]["arguments"]
        assert json.loads(arguments) == {"a": a, "b": b}


async def test_the_recorded_answer_call_sees_the_tool_result(proxy_runs):
    for a, b, _, calls in proxy_runs.values():
        assert calls[1].request["messages"][-1]["content"] == str(a + b)


async def test_proxy_records_have_a_logprob_per_token(proxy_runs):
    for *_, calls in proxy_runs.values():
        for c in calls:
            assert len(c.completions[0].token_ids) == len(c.completions[0].logprobs) > 0


async def test_a_client_that_cannot_set_headers_names_its_rollout_in_metadata(proxy, agent_model):
    async with httpx2.AsyncClient(base_url=proxy.base_url, timeout=120,
                                 headers={"Authorization": f"Bearer {proxy.master_key}"}) as client:
        r = await client.post("/chat/completions", json={
            "model": "agent", "max_tokens": 2, "metadata": {"rollout_id": "ro-proxy-metadata"},
            "messages": [{"role": "user", "content": "hi"}]})
    r.raise_for_status()
    (call,) = await agent_model.fetch_calls("ro-proxy-metadata")
    assert call.request["messages"] == [{"role": "user", "content": "hi"}]
