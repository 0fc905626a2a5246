"""One model name in two projects of one backend: every way the library names a model
(``get_inference_name``, its clients, LangChain, the Agents SDK, LiteLLM, ``tracerl proxy``,
RULER with the trainee as judge) reaches the model of the right project, and the call is
recorded under it. ``alpha/agent`` is registered first, ``beta/agent`` after it: a bare
``agent`` handed out at alpha's registration became ambiguous then (the gateway answers 404)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import httpx2
import pytest

import tracerl
from tests.remote_server import ROOT, free_port
from tracerl.core.storage import read_jsonl

LITELLM_PYTHON = os.environ.get("TRACERL_LITELLM_PYTHON")
CONFIG = tracerl.ModelConfig(engine=tracerl.EngineConfig(max_model_len=512))
SAY = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
async def twins(tmp_path_factory):
    backend = tracerl.LocalBackend(path=tmp_path_factory.mktemp("names"), engine="transformers")
    alpha, beta = (tracerl.TrainableModel(name="agent", project=p, base_model="smollm2",
                                          config=CONFIG) for p in ("alpha", "beta"))
    await alpha.register(backend)
    await beta.register(backend)  # after alpha: alpha's name must not have become ambiguous
    yield SimpleNamespace(backend=backend, alpha=alpha, beta=beta)
    await backend.close()


async def recorded_under(twins, rollout_id: str) -> dict[str, int]:
    """How many calls of ``rollout_id`` each project's `agent` recorded."""
    return {m.project: len(await m.fetch_calls(rollout_id)) for m in (twins.alpha, twins.beta)}


def test_each_project_is_named_qualified(twins):
    assert twins.alpha.get_inference_name() == "alpha/agent"
    assert twins.beta.get_inference_name(3) == "beta/agent@3"
    assert twins.backend.inference_name(twins.alpha) == "alpha/agent"


@pytest.mark.parametrize("project", ["alpha", "beta"])
async def test_the_openai_clients_reach_their_own_project(twins, project):
    model = getattr(twins, project)
    other = "beta" if project == "alpha" else "alpha"
    with tracerl.rollout_scope() as ro:
        await model.openai_client().chat.completions.create(
            model=model.get_inference_name(), messages=SAY, max_tokens=2)
        model.sync_openai_client().chat.completions.create(
            model=model.get_inference_name(0), messages=SAY, max_tokens=2)
    assert await recorded_under(twins, ro.rollout_id) == {project: 2, other: 0}


async def test_langchain_init_chat_model_reaches_alpha(twins):
    pytest.importorskip("langchain_openai")
    from tracerl.langgraph import init_chat_model

    llm = init_chat_model(twins.alpha, max_tokens=2)
    with tracerl.rollout_scope() as ro:
        await llm.ainvoke(SAY)
    assert await recorded_under(twins, ro.rollout_id) == {"alpha": 1, "beta": 0}


@pytest.mark.parametrize("agent_model", [None, "agent", "agent@0", "alpha/agent"])
async def test_the_agents_sdk_provider_reaches_alpha(twins, agent_model):
    pytest.importorskip("agents")
    from agents import Agent, ModelSettings, RunConfig, Runner

    from tracerl.integrations.openai_agents import TracerlModelProvider

    agent = Agent(name="a", instructions="Answer briefly.", model=agent_model,
                  model_settings=ModelSettings(max_tokens=2))
    provider = TracerlModelProvider(twins.alpha, tracing=False)
    with tracerl.rollout_scope() as ro:
        await Runner.run(agent, "Say hi.", run_config=RunConfig(model_provider=provider,
                                                                 tracing_disabled=True))
    assert await recorded_under(twins, ro.rollout_id) == {"alpha": 1, "beta": 0}


async def test_litellm_params_reach_beta(twins):
    litellm = pytest.importorskip("litellm")
    from tracerl.integrations.litellm import completion_kwargs

    with tracerl.rollout_scope() as ro:
        await litellm.acompletion(messages=SAY, max_tokens=2, **completion_kwargs(twins.beta))
        await litellm.acompletion(messages=SAY, max_tokens=2,
                                  **twins.beta.litellm_completion_params())
    assert await recorded_under(twins, ro.rollout_id) == {"alpha": 0, "beta": 2}


async def test_ruler_judging_with_the_trainee_reaches_alpha(twins):
    from tracerl.ruler import ruler_score_group

    group = tracerl.TrajectoryGroup(
        [tracerl.Trajectory(messages_and_choices=[*SAY, {"role": "assistant", "content": a}])
         for a in ("hi", "no")])
    with tracerl.rollout_scope() as ro:  # so the gateway files the judge's calls
        # SmolLM2 is no judge: the scores may not parse; the call is what is checked
        await ruler_score_group(group, twins.alpha.get_inference_name(),
                                client=twins.alpha.openai_client(), swallow_exceptions=True,
                                max_retries=0, max_tokens=4, structured_output=False)
    assert await recorded_under(twins, ro.rollout_id) == {"alpha": 1, "beta": 0}


def run_proxy(tmp_path: Path, backend_url: str, model: str, port: int
              ) -> subprocess.Popen[str]:
    """``tracerl proxy`` as documented, from a fresh directory: its default ``--dir`` (the
    port is given: 4000 may be taken on a shared machine)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRACERL_LITELLM_PYTHON": LITELLM_PYTHON or ""}
    env.pop("LITELLM_MASTER_KEY", None)
    return subprocess.Popen(
        [sys.executable, "-m", "tracerl", "proxy", "--backend-url", backend_url,
         "--model", model, "--port", str(port)],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def proxy_banner(proc: subprocess.Popen[str]) -> dict[str, str]:
    """The proxy's URL and master key, from the lines it prints once it answers."""
    seen: list[str] = []
    for line in proc.stdout:  # ends when the command exits
        seen.append(line)
        if line.startswith("master key:"):
            url = next(s for s in seen if s.startswith("LiteLLM proxy:"))
            return {"url": url.split(": ", 1)[1].strip(), "key": line.split(":", 1)[1].strip()}
    raise AssertionError(f"tracerl proxy exited with {proc.wait()}:\n{''.join(seen)[-3000:]}")


@pytest.mark.skipif(not LITELLM_PYTHON, reason="TRACERL_LITELLM_PYTHON (LiteLLM's proxy venv)")
async def test_tracerl_proxy_from_a_fresh_directory_reaches_alpha(twins, tmp_path):
    proc = run_proxy(tmp_path, twins.backend.base_url, "alpha/agent", free_port())
    try:
        banner = proxy_banner(proc)
        async with httpx2.AsyncClient(base_url=banner["url"], timeout=120,
                                      headers={"authorization": f"Bearer {banner['key']}",
                                               "x-rollout-id": "ro-proxy-alpha"}) as http:
            r = await http.post("/chat/completions", json={
                "model": "alpha/agent", "messages": SAY, "max_tokens": 2})
        assert r.status_code == 200, r.text
    finally:
        proc.terminate()
        proc.wait(60)
    assert await recorded_under(twins, "ro-proxy-alpha") == {"alpha": 1, "beta": 0}
    run_dir = tmp_path / ".tracerl" / "proxy"  # the default --dir, relative to the cwd
    assert (run_dir / "config.yaml").exists() and (run_dir / "master_key").exists()
    assert not (run_dir / ".tracerl").exists()


@pytest.mark.skipif(not LITELLM_PYTHON, reason="TRACERL_LITELLM_PYTHON (LiteLLM's proxy venv)")
def test_tracerl_proxy_refuses_a_bare_name_two_projects_serve(twins, tmp_path):
    proc = run_proxy(tmp_path, twins.backend.base_url, "agent", free_port())
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2, out
    assert "alpha/agent" in out and "beta/agent" in out and "--model agent" in out


async def test_a_bare_name_two_projects_serve_is_refused_and_recorded_nowhere(twins):
    with tracerl.rollout_scope() as ro:
        r = httpx2.post(f"{twins.backend.base_url}/chat/completions", json={
            "model": "agent", "messages": SAY, "max_tokens": 1},
            headers={"x-rollout-id": ro.rollout_id, "authorization": "Bearer x"}, timeout=60)
    assert r.status_code == 404 and "alpha/agent" in r.json()["error"]["message"]
    assert await recorded_under(twins, ro.rollout_id) == {"alpha": 0, "beta": 0}
    assert not read_jsonl(twins.backend.store(twins.alpha).unattributed_calls_path)
