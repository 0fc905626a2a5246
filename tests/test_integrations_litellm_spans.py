"""Spans of proxied calls: the LiteLLM proxy's callback posts one ``llm`` span per call of a
rollout to the gateway, after the response; the span is linked to the gateway's token record,
in trajectories gathered in-process and in those of rollouts opened by an outside service. The
callback announces the span's id in the call's tags, so finishing a rollout waits for the post:
no rollout has to wait for its spans itself."""

from __future__ import annotations

import logging
import os
import time

import httpx2
import pytest

pytest.importorskip("litellm")

import tracerl
from tests.conftest import until
from tests.remote_server import registered_on
from tracerl.integrations.litellm_proxy import LiteLLMProxy

LITELLM_PYTHON = os.environ.get("TRACERL_LITELLM_PYTHON")
HI = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def proxy(tf_backend, agent_model, tmp_path_factory):
    if not LITELLM_PYTHON:
        pytest.skip("TRACERL_LITELLM_PYTHON (a venv with LiteLLM's proxy) is not set")
    backend, _ = tf_backend
    with LiteLLMProxy(upstream_base_url=backend.base_url, model_names=["agent"],
                      python=LITELLM_PYTHON, directory=tmp_path_factory.mktemp("proxy-spans")
                      ) as p:
        yield p


@pytest.fixture(scope="module")
async def http(proxy):
    async with httpx2.AsyncClient(base_url=proxy.base_url, timeout=120, headers={
            "Authorization": f"Bearer {proxy.master_key}"}) as client:
        yield client


async def proxied_call(http: httpx2.AsyncClient, rollout_id: str, model: str = "agent",
                       **body) -> httpx2.Response:
    return await http.post("/chat/completions", headers={"x-rollout-id": rollout_id},
                           json={"model": model, "max_tokens": 4, "messages": HI, **body})


async def spans_posted(model, rollout_id: str, n: int = 1) -> list[tracerl.Span]:
    """Wait (with a deadline) for the proxy's after-response span posts of ``rollout_id``."""
    async def posted() -> bool:
        return len(await model.fetch_spans(rollout_id)) >= n

    await until(posted, f"the proxy to post {n} span(s) of rollout {rollout_id}", 60)
    return await model.fetch_spans(rollout_id)


@pytest.fixture(scope="module")
async def in_process(http, agent_model):
    """Two of tracerl's own rollouts calling through the proxy, gathered in-process."""
    async def rollout(i: int) -> tracerl.Trajectory:
        headers = tracerl.rollout_headers(agent_model)  # the rollout collects agent's records
        r = await proxied_call(http, headers["x-rollout-id"])
        r.raise_for_status()
        return tracerl.Trajectory(reward=float(i), metadata={"response_id": r.json()["id"]})

    (group,) = await tracerl.gather_trajectory_groups(
        [tracerl.TrajectoryGroup(rollout(i) for i in range(2))], show_progress=False)
    return group


async def test_an_in_process_rollout_through_the_proxy_carries_its_linked_span(in_process):
    for t in in_process.trajectories:
        (call,) = t.llm_calls
        (span,) = t.spans
        assert (span.kind, span.framework, span.name) == ("llm", "litellm-proxy", "agent")
        assert span.call_id == call.id and call.metadata["span_id"] == span.id
        assert span.response_id == call.response["id"]  # linked by the provider response id
        assert span.error is None and span.start_time <= span.end_time
        assert span.id == call.metadata["tags"]["posted_span_id"]  # announced before the call


async def test_an_outside_services_rollout_through_the_proxy_carries_its_span(http, agent_model,
                                                                             tf_backend):
    backend, _ = tf_backend
    root = backend.base_url.removesuffix("/v1")
    ids = []
    async with httpx2.AsyncClient(base_url=root, timeout=60) as gateway:
        for reward in (0.0, 1.0):
            opened = (await gateway.post("/v1/rollouts", json={
                "model": "agent", "group": "via-proxy", "group_size": 2})).json()
            r = await proxied_call(http, opened["rollout_id"])
            assert r.status_code == 200, r.text
            await gateway.post(f"/v1/rollouts/{opened['rollout_id']}/finish",
                               json={"reward": reward})
            ids.append(opened["rollout_id"])
    (group,) = await tracerl.gather_external_groups(agent_model, 1, timeout_s=30)
    assert [t.rollout_id for t in group.trajectories] == ids
    for t in group.trajectories:
        (call,), (span,) = t.llm_calls, t.spans
        assert (span.framework, span.call_id, span.response_id) == (
            "litellm-proxy", call.id, call.response["id"])


async def proxied_rollout(http: httpx2.AsyncClient, model, n_calls: int) -> tracerl.Trajectory:
    """A rollout that makes ``n_calls`` calls through the proxy, as curl would, and returns at
    once after the last answer: its spans are still being posted."""
    headers = tracerl.rollout_headers(model)
    for _ in range(n_calls):
        (await proxied_call(http, headers["x-rollout-id"])).raise_for_status()
    return tracerl.Trajectory(reward=float(n_calls))


def assert_every_call_has_its_span(t: tracerl.Trajectory, n_calls: int) -> None:
    assert len(t.llm_calls) == n_calls, t.rollout_id
    assert len(t.spans) == n_calls, (t.rollout_id, [s.id for s in t.spans])
    for call in t.llm_calls:
        (span,) = [s for s in t.spans if s.call_id == call.id]
        assert call.metadata["span_id"] == span.id == call.metadata["tags"]["posted_span_id"]
        assert (span.framework, span.response_id) == ("litellm-proxy", call.response["id"])


async def test_rollouts_that_return_at_their_last_answer_carry_every_calls_span(
        http, agent_model):
    """Single-call and three-call rollouts return the moment their last proxied call answers;
    finishing them waits for the spans their calls announced. (Before, the last call's span
    was posted after the rollout had been finished, and was missing from its trajectory.)"""
    single, multi = await tracerl.gather_trajectory_groups([
        tracerl.TrajectoryGroup(proxied_rollout(http, agent_model, 1) for _ in range(4)),
        tracerl.TrajectoryGroup(proxied_rollout(http, agent_model, 3) for _ in range(3)),
    ], show_progress=False)
    for group, n_calls in ((single, 1), (multi, 3)):
        assert len(group.trajectories) == len(group) and not group.exceptions
        for t in group.trajectories:
            assert_every_call_has_its_span(t, n_calls)


async def test_an_outside_service_finishing_at_its_last_answer_gets_every_span(
        http, agent_model, tf_backend):
    """The rollout API: the service finishes each rollout right after its last proxied call;
    the group handed to the trainer still has a span for every call."""
    backend, _ = tf_backend
    async with httpx2.AsyncClient(base_url=backend.base_url.removesuffix("/v1"),
                                  timeout=60) as gateway:
        for n_calls in (1, 2):
            opened = (await gateway.post("/v1/rollouts", json={
                "model": "agent", "group": "finish-at-once", "group_size": 2})).json()
            for _ in range(n_calls):
                r = await proxied_call(http, opened["rollout_id"])
                assert r.status_code == 200, r.text
            (await gateway.post(f"/v1/rollouts/{opened['rollout_id']}/finish",
                                json={"reward": float(n_calls)})).raise_for_status()
    (group,) = await tracerl.gather_external_groups(agent_model, 1, timeout_s=30)
    for t, n_calls in zip(group.trajectories, (1, 2), strict=True):
        assert_every_call_has_its_span(t, n_calls)


async def test_a_span_announced_but_never_posted_is_waited_for_until_the_deadline(
        agent_model, monkeypatch, caplog):
    """A call tagged with the id of a span that never comes (the proxy died before posting):
    the rollout's finish waits ``TRACERL_SPAN_WAIT_S``, then names the span in a warning."""
    monkeypatch.setenv("TRACERL_SPAN_WAIT_S", "0.5")

    async def rollout() -> tracerl.Trajectory:
        with tracerl.call_tags(posted_span_id="litellm-never-posted"):
            await agent_model.openai_client().chat.completions.create(
                model=agent_model.get_inference_name(), messages=HI, max_tokens=2)
        return tracerl.Trajectory(reward=0.0)

    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="tracerl.rollout.gather"):
        (t,) = await tracerl.gather_trajectories([rollout()], show_progress=False)
    assert time.monotonic() - started >= 0.5
    assert len(t.llm_calls) == 1 and t.spans == []
    assert any("litellm-never-posted" in r.getMessage() for r in caplog.records)


async def test_a_call_the_gateway_refuses_is_a_failed_span(http, agent_model):
    rollout_id = "ro-proxy-span-refused"
    r = await proxied_call(http, rollout_id, temperature=-3)
    assert r.status_code >= 400
    (span,) = await spans_posted(agent_model, rollout_id)
    assert span.error and span.call_id is None and span.response_id is None


async def test_a_keyed_gateway_takes_the_proxys_span_posts(faults_server, tmp_path_factory):
    """Behind ``tracerl serve``'s key, the proxy's span post carries the key it calls with
    (LiteLLM's ``api_key``): a post without it would be refused with a 401, and only logged."""
    if not LITELLM_PYTHON:
        pytest.skip("TRACERL_LITELLM_PYTHON (a venv with LiteLLM's proxy) is not set")
    model = await registered_on(faults_server.url, "spans-keyed", "keyed",
                                tracerl.ModelConfig(engine=tracerl.EngineConfig(max_model_len=256)))
    base_url, key = model.endpoint()
    assert key != "tracerl"  # the server's key, not the loopback placeholder
    try:
        with LiteLLMProxy(upstream_base_url=base_url, upstream_api_key=key,
                          model_names=[model.name], python=LITELLM_PYTHON,
                          directory=tmp_path_factory.mktemp("proxy-keyed")) as p:
            async with httpx2.AsyncClient(base_url=p.base_url, timeout=120, headers={
                    "Authorization": f"Bearer {p.master_key}"}) as http:
                with tracerl.rollout_scope():
                    rollout_id = tracerl.rollout_headers(model)["x-rollout-id"]
                    r = await proxied_call(http, rollout_id, model=model.name)
                assert r.status_code == 200, r.text
                (span,) = await spans_posted(model, rollout_id)
        (call,) = await model.fetch_calls(rollout_id)
        # the link a gathered trajectory makes: the provider response id of the recorded call
        assert (span.framework, span.response_id) == ("litellm-proxy", call.response["id"])
    finally:
        await model.backend.close()


async def test_a_responses_call_through_the_proxy_carries_its_span(http, agent_model, caplog):
    """A Responses API call through the proxy: its span is posted as a chat call's is, linked
    to the recorded call, so the rollout's finish does not wait for a span that never comes
    (before: recorded with its tokens, then the finish waited ``TRACERL_SPAN_WAIT_S`` and
    warned)."""
    async def rollout() -> tracerl.Trajectory:
        headers = tracerl.rollout_headers(agent_model)
        r = await http.post("/responses", headers={"x-rollout-id": headers["x-rollout-id"]},
                            json={"model": "agent", "input": "Say hi.",
                                  "max_output_tokens": 4})
        assert r.status_code == 200, r.text
        return tracerl.Trajectory(reward=0.0, metadata={"response_id": r.json()["id"]})

    with caplog.at_level(logging.WARNING, logger="tracerl.rollout.gather"):
        (t,) = await tracerl.gather_trajectories([rollout()], show_progress=False)
    assert not [r for r in caplog.records if "span" in r.getMessage()], caplog.text
    (call,) = t.llm_calls
    (span,) = t.spans
    assert (span.kind, span.framework) == ("llm", "litellm-proxy")
    assert span.call_id == call.id and call.metadata["span_id"] == span.id
    assert span.id == call.metadata["tags"]["posted_span_id"]
    # the id the client was answered with (LiteLLM bridges Responses to a chat call upstream)
    assert span.response_id == t.metadata["response_id"]
