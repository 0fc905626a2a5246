"""ART's ``generate_scenarios``: ask a model for ``num_scenarios`` realistic tasks that an MCP
server's tools can accomplish, each with a difficulty from 1 to 5, through structured output
(a JSON schema). ART's signature and prompt; the call is asynchronous here (ART's blocks the
event loop), and a bad answer raises a ``ConfigError`` naming what was wrong.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from ..core import settings
from ..core.errors import ConfigError
from .types import GeneratedScenarioCollection, MCPResource, MCPTool

log = logging.getLogger("tracerl.mcp")

PROMPT = """You are an expert at creating realistic scenarios for testing AI agents that interact with MCP (Model Context Protocol) servers.

Given the following available tools and resources from an MCP server, generate {n} diverse, realistic scenarios that a user might want to accomplish using these tools.

AVAILABLE TOOLS:
{tools}

AVAILABLE RESOURCES:
{resources}

Requirements for scenarios:
1. Each scenario should be a task that can be accomplished using the available tools
2. Scenarios should vary in complexity - some simple (1-2 tool calls), some complex (multiple tool calls)
3. Scenarios should cover different use cases and tool combinations (though the task should not specify which tools to use)
4. Each scenario should be realistic - something a real user might actually want to do
5. Assign a difficulty rating from 1 (easy, single tool call) to 5 (hard, complex multi-step analysis)
6. The task should always include generating a summary of the work done and a thorough analysis and report of the results

You must respond with a JSON object containing a "scenarios" array of exactly {n} objects. Each object must have:
- "task": string describing the scenario
- "difficulty": integer from 1-5 representing complexity
"""  # noqa: E501  (ART's prompt, verbatim)


def _schema(n: int) -> dict[str, Any]:
    scenario = {"type": "object",
                "properties": {"task": {"type": "string"},
                               "difficulty": {"type": "integer", "minimum": 1, "maximum": 5}},
                "required": ["task", "difficulty"], "additionalProperties": False}
    return {"type": "object",
            "properties": {"scenarios": {"type": "array", "items": scenario,
                                         "minItems": n, "maxItems": n}},
            "required": ["scenarios"], "additionalProperties": False}


def _as_dicts(items: list[Any], kind: type[MCPTool] | type[MCPResource]) -> list[dict[str, Any]]:
    return [item.to_dict() if isinstance(item, kind) else dict(item) for item in items]


def _parse(content: str | None, n: int) -> GeneratedScenarioCollection:
    if content is None:
        raise ConfigError("the generator model answered no content")
    try:
        result = json.loads(content)
    except json.JSONDecodeError as e:
        raise ConfigError(f"the generator model's answer is not JSON ({e}): "
                          f"{content[:500]!r}") from e
    scenarios = result
    if isinstance(result, dict):
        scenarios = result.get("scenarios", next(iter(result.values()), None))
    if not isinstance(scenarios, list) or len(scenarios) != n:
        got = len(scenarios) if isinstance(scenarios, list) else type(scenarios).__name__
        raise ConfigError(f"scenarios: expected {n} scenarios, got {got}")
    return GeneratedScenarioCollection.from_dicts(scenarios)


async def generate_scenarios(
    tools: list[MCPTool] | list[dict[str, Any]],
    resources: list[MCPResource] | list[dict[str, Any]] | None = None,
    num_scenarios: int = 24,
    show_preview: bool = True,
    custom_instructions: str | None = None,
    generator_model: str = "openai/gpt-4.1-mini",
    generator_api_key: str | None = None,
    generator_base_url: str = "https://openrouter.ai/api/v1",
) -> GeneratedScenarioCollection:
    """``num_scenarios`` tasks for ``tools`` (and ``resources``) written by ``generator_model``
    at ``generator_base_url`` (OpenRouter by default; the key from ``OPENROUTER_API_KEY`` when
    ``generator_api_key`` is None)."""
    from openai import AsyncOpenAI

    started = time.perf_counter()
    api_key = generator_api_key or settings.OPENROUTER_API_KEY.get()
    if not api_key:
        raise ConfigError("generator_api_key is required or OPENROUTER_API_KEY env var must be set")
    if not tools and not resources:
        raise ConfigError("tools: at least one tool or resource must be provided")
    if isinstance(num_scenarios, bool) or not isinstance(num_scenarios, int) or num_scenarios < 1:
        raise ConfigError(f"num_scenarios must be a positive integer, got {num_scenarios!r}")
    tools_info = _as_dicts(list(tools), MCPTool)
    resources_info = _as_dicts(list(resources or []), MCPResource)
    prompt = PROMPT.format(
        n=num_scenarios, tools=json.dumps(tools_info, indent=2),
        resources=json.dumps(resources_info, indent=2) if resources_info
        else "No resources available")
    if custom_instructions:
        prompt += ("\n\nPay close attention to the following instructions when generating "
                   f"scenarios:\n\n{custom_instructions}")
    async with AsyncOpenAI(api_key=api_key, base_url=generator_base_url) as client:
        response = await client.chat.completions.create(
            model=generator_model, messages=[{"role": "user", "content": prompt}],
            max_completion_tokens=8000,
            response_format={"type": "json_schema", "json_schema": {
                "name": "scenario_list", "schema": _schema(num_scenarios)}})
    collection = _parse(response.choices[0].message.content, num_scenarios)
    collection.print_difficulty_distribution()
    if show_preview:
        collection.preview(n=min(5, num_scenarios))
    log.info("generated %d scenarios with %s in %.2f s", len(collection), generator_model,
             time.perf_counter() - started)
    return collection


__all__ = ["generate_scenarios"]
