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
    litellm.callbacks = []


async def test_sdk_calls_are_attributed_and_paired(tf_backend, logger):
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
        return tracerl.Trajectory(reward=1.0, metadata={"text": text, "word": word})

    (group,) = await tracerl.gather_trajectory_groups(
        [
            tracerl.TrajectoryGroup(
                rollout(w, stream=i % 2 == 1) for i, w in enumerate(["yes", "no", "maybe", "ok"])
            )
        ],
        show_progress=False,
    )
    assert not group.exceptions
    for i, traj in enumerate(group.trajectories):
        (call,) = traj.llm_calls
        assert call.request["messages"][0]["content"] == f"Say {traj.metadata['word']}"
        assert call.streamed == (i % 2 == 1) and call.completions[0].text == traj.metadata["text"]
        (span,) = traj.spans
        assert span.framework == "litellm" and span.call_id == call.id and span.end_time
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
    assert len(ro.spans) == 1, [(s.id, s.name, s.error, s.attributes) for s in ro.spans]
    (span,) = ro.spans
    assert span.error and "no-such-model" in span.error


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


async def test_proxy_tool_loop_from_plain_http(proxy, agent_model):
    """An agent that speaks only HTTP (as one in any language would) trains through the proxy."""
    assert proxy.host == "127.0.0.1"
    tools = {"add": lambda a, b: a + b}

    async def agent(client: httpx2.AsyncClient, rollout_id: str, a: int, b: int) -> list[dict]:
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
                result = tools[tc["function"]["name"]](**json.loads(tc["function"]["arguments"]))
                messages.append({"role": "tool", "tool_call_id": tc["id"], "content": str(result)})
        return messages

    async with httpx2.AsyncClient(base_url=proxy.base_url, timeout=120,
                                 headers={"Authorization": f"Bearer {proxy.master_key}"}) as client:
        denied = await client.post(
            "/chat/completions",
            headers={"Authorization": "Bearer wrong"},
            json={"model": "agent", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert denied.status_code in (400, 401)
        runs = await asyncio.gather(
            agent(client, "ro-proxy-a", 3, 4), agent(client, "ro-proxy-b", 12, 30)
        )
    for rid, (a, b), messages in zip(
        ("ro-proxy-a", "ro-proxy-b"), [(3, 4), (12, 30)], runs, strict=True
    ):
        assert str(a + b) in messages[-1]["content"]
        calls = await agent_model.fetch_calls(rid)
        assert len(calls) == 2  # the tool call and the answer, each recorded under its rollout
        assert json.loads(calls[0].completions[0].tool_calls[0]["function"]["arguments"]) == {
            "a": a,
            "b": b,
        }
        assert calls[1].request["messages"][-1]["content"] == str(a + b)
        assert all(
            len(c.completions[0].token_ids) == len(c.completions[0].logprobs) > 0 for c in calls
        )
    assert (Path(proxy.directory) / "config.yaml").exists()
