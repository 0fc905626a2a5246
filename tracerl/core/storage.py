"""On-disk layout of a model and atomic file operations.

``{base}/{project}/models/{name}/``
    ``model.json``                      the model's definition
    ``history.jsonl``                   one line of metrics per logged step and split
    ``trajectories/{split}/{step:04d}.jsonl``   groups, written before training on them
    ``checkpoints/{step:04d}/``         LoRA adapters; a folder appears only when complete
    ``calls/{rollout_id}.jsonl``        raw gateway records (backend side)
    ``calls/_unattributed.jsonl``       records of calls made without a rollout id
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .errors import ConfigError

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # fullmatch: no trailing newline
_CHECKPOINT_RE = re.compile(r"^\d{4,}$")


def validate_name(kind: str, value: str) -> str:
    """Reject names that could escape a directory or confuse a URL (``..``, ``/``, spaces...)."""
    if not isinstance(value, str) or not _NAME_RE.fullmatch(value) or ".." in value:
        raise ConfigError(
            f"invalid {kind} name {value!r}: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit, and no '..'"
        )
    return value


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` so that readers see either the old file or the whole new one."""
    atomic_write_bytes(path, text.encode())


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` so that readers see either the old file or the whole new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """Append one JSON line and fsync it (a crash loses at most a partial last line)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps(record, allow_nan=False) + "\n"
    with open(path, "a") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Read a JSONL file, skipping a torn last line left by a crash."""
    path = Path(path)
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                continue  # torn tail from a crash mid-append
            raise
    return out


@contextmanager
def atomic_directory(final: Path) -> Iterator[Path]:
    """Yield a temporary folder; on success it is renamed to ``final`` in one step."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.", suffix=".tmp"))
    try:
        yield tmp
        for p in tmp.rglob("*"):
            if p.is_file():
                with open(p, "rb") as f:
                    os.fsync(f.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


class ModelStore:
    """The folder of one model and the files in it."""

    def __init__(self, base_path: Path | str, project: str, name: str) -> None:
        self.project = validate_name("project", project)
        self.name = validate_name("model", name)
        self.root = Path(base_path).expanduser().resolve() / project / "models" / name

    @property
    def history_path(self) -> Path:
        return self.root / "history.jsonl"

    @property
    def checkpoints_dir(self) -> Path:
        return self.root / "checkpoints"

    def checkpoint_dir(self, step: int) -> Path:
        return self.checkpoints_dir / f"{step:04d}"

    def trajectories_path(self, split: str, step: int) -> Path:
        validate_name("split", split)
        return self.root / "trajectories" / split / f"{step:04d}.jsonl"

    def calls_path(self, rollout_id: str) -> Path:
        validate_name("rollout id", rollout_id)
        return self.root / "calls" / f"{rollout_id}.jsonl"

    @property
    def unattributed_calls_path(self) -> Path:
        """Calls made without a rollout id; its name cannot be a rollout id (leading ``_``)."""
        return self.root / "calls" / "_unattributed.jsonl"

    @property
    def key(self) -> tuple[str, str]:
        """The model's identity: ``(project, name)``."""
        return self.project, self.name

    def checkpoint_steps(self) -> list[int]:
        """Steps with a complete checkpoint, ascending (temporary folders are ignored)."""
        if not self.checkpoints_dir.exists():
            return []
        return sorted(
            int(p.name) for p in self.checkpoints_dir.iterdir()
            if p.is_dir() and _CHECKPOINT_RE.match(p.name)
        )

    def remove_partial_checkpoints(self) -> list[Path]:
        """Delete temporary checkpoint folders left by a crash mid-save."""
        if not self.checkpoints_dir.exists():
            return []
        partial = [
            p for p in self.checkpoints_dir.iterdir() if p.is_dir() and p.name.endswith(".tmp")
        ]
        for p in partial:
            shutil.rmtree(p, ignore_errors=True)
        return partial

    def latest_step(self) -> int:
        steps = self.checkpoint_steps()
        return steps[-1] if steps else 0

    def log_history(self, step: int, split: str, metrics: dict[str, float]) -> None:
        append_jsonl(self.history_path,
                     {"step": step, "split": split, "time": time.time(), **metrics})

    def history(self) -> list[dict[str, Any]]:
        return read_jsonl(self.history_path)

    def write_definition(self, definition: dict[str, Any]) -> None:
        atomic_write_text(self.root / "model.json", json.dumps(definition, indent=2))

    def delete_checkpoints(self, keep: set[int]) -> list[int]:
        """Delete every checkpoint whose step is not in ``keep``; return the deleted steps."""
        deleted = []
        for step in self.checkpoint_steps():
            if step not in keep:
                shutil.rmtree(self.checkpoint_dir(step))
                deleted.append(step)
        return deleted
