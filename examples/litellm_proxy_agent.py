"""Train through a LiteLLM proxy: the agent speaks plain HTTP to the proxy (as an agent in
any language would) and tags requests with the rollout's headers (CPU, a few steps).

Needs a venv with LiteLLM's proxy (`make setup-litellm`); pass its python with
TRACERL_LITELLM_PYTHON=.venv-litellm/bin/python.

    TRACERL_LITELLM_PYTHON=.venv-litellm/bin/python \
        .venv/bin/python examples/litellm_proxy_agent.py --steps 2
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx2
from calculator_task import ADD_TOOL, SYSTEM, answer_reward, examples, question, tool_model
from common import parse_args, train_loop

import tracerl
from tracerl.integrations.litellm_proxy import LiteLLMProxy


async def http_agent(base_url: str, key: str, headers: dict[str, str], a: int, b: int) -> str:
    """The existing agent: an OpenAI-style tool loop over raw HTTP."""
    messages = [{"role": "system", "content": SYSTEM}, *examples(), question(a, b)]
    async with httpx2.AsyncClient(base_url=base_url, timeout=300,
                                 headers={"Authorization": f"Bearer {key}", **headers}) as client:
        for _ in range(3):
            r = await client.post("/chat/completions", json={
                "model": "proxy-calc", "messages": messages, "tools": [ADD_TOOL], "max_tokens": 60})
            r.raise_for_status()
            message = r.json()["choices"][0]["message"]
            messages.append({k: v for k, v in message.items()
                             if k in ("role", "content", "tool_calls")})
            if not message.get("tool_calls"):
                return message.get("content") or ""
            for tc in message["tool_calls"]:
                args = json.loads(tc["function"]["arguments"])
                result = int(args.get("a", 0)) + int(args.get("b", 0))
                messages.append({"role": "tool", "tool_call_id": tc["id"], "content": str(result)})
    return ""


async def main() -> None:
    args = parse_args(__doc__)
    backend = tracerl.LocalBackend(path=args.path, engine="transformers")
    model = tool_model("proxy-calc")
    await model.register(backend)
    with LiteLLMProxy(upstream_base_url=backend.base_url, model_names=[model.name],
                      directory=Path(args.path) / "proxy") as proxy:
        async def rollout(a: int, b: int) -> tracerl.Trajectory:
            text = await http_agent(proxy.base_url, proxy.master_key,
                                    tracerl.rollout_headers(model), a, b)
            return tracerl.Trajectory(reward=answer_reward(text, a + b))

        await train_loop(model, rollout, args)
    await backend.close()


if __name__ == "__main__":
    asyncio.run(main())
