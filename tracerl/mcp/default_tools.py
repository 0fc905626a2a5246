"""ART's default MCP tool: ``complete_task``, which an agent calls with a summary to finish."""

from __future__ import annotations

from .types import MCPTool

complete_task_tool = MCPTool(
    name="complete_task",
    description="Complete a task",
    parameters={
        "type": "object",
        "properties": {
            "summary": {"type": "string", "description": "Summary of accomplishments"},
        },
        "required": ["summary"],
    },
)

__all__ = ["complete_task_tool"]
