"""ART's ``art.utils.benchmarking``, over a tracerl backend folder: the logged trajectories and
metrics of several models (trained or comparison ones) side by side.

ART returns polars DataFrames; these return rows (dicts), which ``polars.DataFrame(rows)`` or
``pandas.DataFrame(rows)`` turn into one (neither is a tracerl dependency).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..core.storage import ModelStore
from ..core.trajectory import read_groups_jsonl


def _models(project_dir: Path, models: list[str] | None) -> list[str]:
    found = sorted(p.name for p in (project_dir / "models").iterdir() if p.is_dir()) if (
        project_dir / "models").is_dir() else []
    return [m for m in found if models is None or m in models]


async def load_trajectories(project_name: str, models: list[str] | None = None,
                            debug: bool = False, art_path: str | Path = ".tracerl"
                            ) -> list[dict[str, Any]]:
    """One row per logged trajectory: ``model``, ``split``, ``step``, ``reward``, each metric
    as ``metric_<name>``, ``metadata``, ``messages`` and the group's index in its file."""
    del debug
    rows = []
    base = Path(art_path)
    for name in _models(base / project_name, models):
        root = ModelStore(base, project_name, name).root / "trajectories"
        for file in sorted(root.glob("*/*.jsonl")) if root.is_dir() else []:
            for group_index, group in enumerate(read_groups_jsonl(file)):
                for t in group.trajectories:
                    rows.append({"model": name, "split": file.parent.name, "step": int(file.stem),
                                 "reward": t.reward, "group_index": group_index,
                                 **{f"metric_{k}": v for k, v in t.metrics.items()},
                                 "metadata": t.metadata, "messages": t.messages()})
    return rows


async def load_latest_metrics(project_name: str, models: list[str] | None = None,
                              split: str = "val", art_path: str | Path = ".tracerl"
                              ) -> dict[str, dict[str, Any]]:
    """Each model's newest history line of ``split`` (its step and metrics), by model name."""
    latest = {}
    base = Path(art_path)
    for name in _models(base / project_name, models):
        lines = [h for h in ModelStore(base, project_name, name).history()
                 if h.get("split") == split]
        if lines:
            latest[name] = max(lines, key=lambda h: (h["step"], h["time"]))
    return latest


__all__ = ["load_latest_metrics", "load_trajectories"]
