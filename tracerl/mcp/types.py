"""ART's ``art.mcp.types``: an MCP server's tools and resources, and generated scenarios (a task
with a difficulty from 1 to 5) with ART's collection helpers. Previews go to the ``tracerl.mcp``
logger (ART prints them)."""

from __future__ import annotations

import json
import logging
import random
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, overload

from ..core.errors import ConfigError

log = logging.getLogger("tracerl.mcp")


@dataclass
class MCPTool:
    """An MCP tool: its name, description and JSON-schema parameters."""

    name: str
    description: str
    parameters: dict[str, Any]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MCPTool:
        return cls(name=data.get("name", ""), description=data.get("description", ""),
                   parameters=data.get("parameters", {}))

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description,
                "parameters": self.parameters}

    def to_tool_schema(self) -> dict[str, Any]:
        """The OpenAI ``tools`` entry of this tool."""
        return {"type": "function", "function": self.to_dict()}


@dataclass
class MCPResource:
    """An MCP resource: its URI, name, description and MIME type."""

    uri: str
    name: str
    description: str
    mime_type: str | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MCPResource:
        return cls(uri=data.get("uri", ""), name=data.get("name", ""),
                   description=data.get("description", ""),
                   mime_type=data.get("mimeType") or data.get("mime_type"))

    def to_dict(self) -> dict[str, Any]:
        result = {"uri": self.uri, "name": self.name, "description": self.description}
        if self.mime_type:
            result["mimeType"] = self.mime_type
        return result


@dataclass
class GeneratedScenario:
    """One task for an agent, with its difficulty (an integer from 1 to 5)."""

    task: str
    difficulty: int

    def __post_init__(self) -> None:
        if isinstance(self.difficulty, bool) or not isinstance(self.difficulty, int) \
                or not 1 <= self.difficulty <= 5:
            raise ConfigError(f"difficulty must be an integer between 1 and 5, got "
                              f"{self.difficulty!r}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GeneratedScenario:
        return cls(task=data["task"], difficulty=data["difficulty"])

    def to_dict(self) -> dict[str, Any]:
        return {"task": self.task, "difficulty": self.difficulty}

    def preview(self, max_length: int = 120) -> str:
        """The task, cut to ``max_length`` characters."""
        if len(self.task) <= max_length:
            return self.task
        return self.task[:max_length].strip() + "…"


class GeneratedScenarioCollection:
    """Scenarios with ART's helpers: JSON in and out, shuffle, split, filter by difficulty."""

    def __init__(self, scenarios: list[GeneratedScenario]):
        self.scenarios = scenarios

    @classmethod
    def from_dicts(cls, data: list[dict[str, Any]]) -> GeneratedScenarioCollection:
        return cls([GeneratedScenario.from_dict(item) for item in data])

    @classmethod
    def from_json(cls, json_str: str) -> GeneratedScenarioCollection:
        """From ``{"scenarios": [...]}``, a bare list, or an object's first value."""
        data = json.loads(json_str)
        if isinstance(data, dict) and "scenarios" in data:
            return cls.from_dicts(data["scenarios"])
        return cls.from_dicts(data if isinstance(data, list) else next(iter(data.values())))

    def to_dicts(self) -> list[dict[str, Any]]:
        return [scenario.to_dict() for scenario in self.scenarios]

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps({"scenarios": self.to_dicts()}, indent=indent)

    def __len__(self) -> int:
        return len(self.scenarios)

    def __iter__(self) -> Iterator[GeneratedScenario]:
        return iter(self.scenarios)

    @overload
    def __getitem__(self, index: int) -> GeneratedScenario: ...

    @overload
    def __getitem__(self, index: slice) -> list[GeneratedScenario]: ...

    def __getitem__(self, index: int | slice) -> GeneratedScenario | list[GeneratedScenario]:
        return self.scenarios[index]

    def shuffle(self) -> GeneratedScenarioCollection:
        """A new collection, shuffled (``random``'s global generator, as in ART)."""
        shuffled = self.scenarios.copy()
        random.shuffle(shuffled)
        return GeneratedScenarioCollection(shuffled)

    def split(self, train_size: int) -> tuple[GeneratedScenarioCollection,
                                              GeneratedScenarioCollection]:
        """The first ``train_size`` scenarios, and the rest."""
        if train_size > len(self.scenarios):
            raise ConfigError(f"train_size ({train_size}) cannot be larger than total scenarios "
                              f"({len(self.scenarios)})")
        return (GeneratedScenarioCollection(self.scenarios[:train_size]),
                GeneratedScenarioCollection(self.scenarios[train_size:]))

    def filter_by_difficulty(self, min_difficulty: int = 1,
                             max_difficulty: int = 5) -> GeneratedScenarioCollection:
        return GeneratedScenarioCollection(
            [s for s in self.scenarios if min_difficulty <= s.difficulty <= max_difficulty])

    def get_difficulty_distribution(self) -> Counter[int]:
        return Counter(scenario.difficulty for scenario in self.scenarios)

    def preview(self, n: int = 5, max_task_length: int = 120) -> None:
        """Log the first ``n`` scenarios."""
        for i, scenario in enumerate(self.scenarios[:n]):
            log.info("   %d. %s  (difficulty %d/5)", i + 1, scenario.preview(max_task_length),
                     scenario.difficulty)

    def print_difficulty_distribution(self) -> None:
        """Log how many scenarios each difficulty has."""
        counts = self.get_difficulty_distribution()
        log.info("Difficulty distribution:")
        for d in range(1, 6):
            log.info("   %d/5: %3d  %s", d, counts.get(d, 0), "█" * min(counts.get(d, 0), 30))

    def get_summary(self) -> dict[str, Any]:
        n = len(self.scenarios)
        return {
            "total_scenarios": n,
            "difficulty_distribution": dict(self.get_difficulty_distribution()),
            "avg_difficulty": sum(s.difficulty for s in self.scenarios) / n if n else 0,
            "avg_task_length": sum(len(s.task) for s in self.scenarios) / n if n else 0,
        }


__all__ = ["GeneratedScenario", "GeneratedScenarioCollection", "MCPResource", "MCPTool"]
