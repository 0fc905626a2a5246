"""Per-call overhead of each framework adapter, against the same call without it.

Peers, in one process against one gateway (transformers engine, SmolLM2, 4 new tokens):
  - raw:        openai.AsyncOpenAI on the gateway, no tracerl client
  - tracerl:    model.openai_client() (rollout attribution hook)
  - langchain:  init_chat_model(...).ainvoke inside a rollout (callback handler installed)
  - langchain-plain: a plain ChatOpenAI on the gateway, no tracerl handler
  - agents:     Runner.run with TracerlModelProvider (tracing processor on)
  - agents-plain: Runner.run with OpenAIChatCompletionsModel, tracing disabled
  - litellm:    litellm.acompletion with completion_kwargs + TracerlLiteLLMLogger
  - litellm-plain: litellm.acompletion to the gateway, no callback

    .venv/bin/python benchmarks/adapter_overhead.py --calls 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time

import openai

import tracerl
from tracerl.integrations.litellm import TracerlLiteLLMLogger, completion_kwargs

MSG = [{"role": "user", "content": "Say hi"}]


async def timed(fn, calls: int) -> float:
    await fn()  # warm-up
    samples = []
    for _ in range(calls):
        t = time.perf_counter()
        await fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples) * 1000


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args()
    import litellm  # after tracerl.integrations.litellm, which sets LiteLLM's offline switches
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, RunConfig, Runner
    from langchain_openai import ChatOpenAI

    from tracerl.integrations.langchain import init_chat_model
    from tracerl.integrations.openai_agents import TracerlModelProvider

    backend = tracerl.LocalBackend(path=tempfile.mkdtemp(), engine="transformers")
    model = tracerl.TrainableModel(name="bench", project="bench", base_model="smollm2")
    await model.register(backend)
    base, key = model.inference_base_url, model.inference_api_key
    raw = openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0)
    ours = model.openai_client()
    lc_ours = init_chat_model(model, max_tokens=4, temperature=0)
    lc_plain = ChatOpenAI(model=model.name, base_url=base, api_key=key, max_tokens=4,
                          temperature=0, max_retries=0)
    settings = ModelSettings(max_tokens=4, temperature=0)
    agent = Agent(name="a", instructions="Be brief.", model_settings=settings)
    provider = TracerlModelProvider(model)
    plain_model = OpenAIChatCompletionsModel(model=model.name, openai_client=raw)
    plain_agent = Agent(name="a", instructions="Be brief.", model_settings=settings,
                        model=plain_model)
    litellm.callbacks = [TracerlLiteLLMLogger()]

    async def in_rollout(coro_fn):
        with tracerl.rollout_scope():
            return await coro_fn()

    async def litellm_plain():
        saved, litellm.callbacks = litellm.callbacks, []
        try:
            return await litellm.acompletion(model=f"hosted_vllm/{model.name}", api_base=base,
                                             api_key=key, messages=MSG, max_tokens=4,
                                             temperature=0, num_retries=0)
        finally:
            litellm.callbacks = saved

    peers = {
        "raw": lambda: raw.chat.completions.create(
            model=model.name, messages=MSG, max_tokens=4, temperature=0),
        "tracerl": lambda: in_rollout(lambda: ours.chat.completions.create(
            model=model.name, messages=MSG, max_tokens=4, temperature=0)),
        "langchain-plain": lambda: lc_plain.ainvoke(MSG),
        "langchain": lambda: in_rollout(lambda: lc_ours.ainvoke(MSG)),
        "agents-plain": lambda: Runner.run(
            plain_agent, "Say hi", run_config=RunConfig(tracing_disabled=True)),
        "agents": lambda: in_rollout(lambda: Runner.run(
            agent, "Say hi", run_config=RunConfig(model_provider=provider))),
        "litellm-plain": litellm_plain,
        "litellm": lambda: in_rollout(lambda: litellm.acompletion(
            messages=MSG, max_tokens=4, temperature=0, **completion_kwargs(model))),
    }
    result = {name: await timed(fn, args.calls) for name, fn in peers.items()}
    result["ratio_tracerl_client_over_raw"] = result["tracerl"] / result["raw"]
    for fw in ("langchain", "agents", "litellm"):
        result[f"ratio_{fw}_adapter_over_plain"] = result[fw] / result[f"{fw}-plain"]
        result[f"{fw}_adapter_overhead_ms"] = result[fw] - result[f"{fw}-plain"]
    print(json.dumps(result, indent=2))
    await backend.close()


if __name__ == "__main__":
    asyncio.run(main())
