"""ART's ``art.mcp``: ``from art.mcp import generate_scenarios`` becomes
``from tracerl.mcp import generate_scenarios``.

- ``types.py``: ``MCPTool``, ``MCPResource``, ``GeneratedScenario``,
  ``GeneratedScenarioCollection`` (ART's classes and methods).
- ``default_tools.py``: ``complete_task_tool``, the tool an MCP agent calls to finish.
- ``generate_scenarios.py``: ``generate_scenarios``, training tasks for an MCP server's tools
  written by a model behind any OpenAI-compatible endpoint.
"""

from .default_tools import complete_task_tool
from .generate_scenarios import generate_scenarios
from .types import GeneratedScenario, GeneratedScenarioCollection, MCPResource, MCPTool

__all__ = ["GeneratedScenario", "GeneratedScenarioCollection", "MCPResource", "MCPTool",
           "complete_task_tool", "generate_scenarios"]
