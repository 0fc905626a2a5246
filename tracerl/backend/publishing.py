"""Versioned adapter publishing: each step's adapter written once, as ``policy@N``, where every
inference server can read it.

The location is a directory (``/dev/shm/...`` on one node: loads from memory; a shared
filesystem across nodes) or an fsspec URL (``s3://...``, ``gs://...``) that the servers see
mounted at ``served_root``. A version appears whole or not at all: it is written under a
temporary name and renamed (directories), or its ``READY`` marker is written last (fsspec).
Only the newest ``keep`` versions stay; older ones are deleted once no server loads them.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from ..core.errors import ConfigError
from ..core.storage import atomic_directory

log = logging.getLogger(__name__)

READY_MARKER = "READY"


def version_name(step: int) -> str:
    return f"policy@{step}"


class AdapterPublisher:
    """Writes ``<location>/<model>/policy@N`` and says where servers load it from."""

    def __init__(self, location: str, served_root: str | None = None) -> None:
        self.location = location.rstrip("/")
        self.is_url = "://" in location and not location.startswith("file://")
        local = location.removeprefix("file://")
        # where the servers load from: as the operator names it, else the local folder
        # (absolute: handed to the servers)
        self.served_root = Path(served_root) if served_root else (
            None if self.is_url else Path(local).expanduser().resolve())
        if self.is_url and self.served_root is None:
            raise ConfigError(f"publishing to {location} needs served_root: the path at which "
                             "the inference servers see it mounted")

    def served_path(self, model: str, step: int) -> Path:
        """Where the servers find version ``step`` of ``model``."""
        assert self.served_root is not None
        return self.served_root / model / version_name(step)

    def publish(self, model: str, step: int, adapter: Path) -> Path:
        """Copy the checkpoint folder ``adapter`` to version ``step``; returns the served path."""
        if self.is_url:
            self._put_fsspec(model, step, adapter)
        else:
            target = self.served_path(model, step)
            target.parent.mkdir(parents=True, exist_ok=True)
            if not target.exists():  # written once: a re-publish of a step is a no-op
                with atomic_directory(target) as tmp:
                    shutil.copytree(adapter, tmp, dirs_exist_ok=True)
        return self.served_path(model, step)

    def _put_fsspec(self, model: str, step: int, adapter: Path) -> None:
        import fsspec

        fs, root = fsspec.core.url_to_fs(f"{self.location}/{model}/{version_name(step)}")
        if fs.exists(f"{root}/{READY_MARKER}"):
            return
        for f in sorted(p for p in Path(adapter).rglob("*") if p.is_file()):
            fs.put_file(str(f), f"{root}/{f.relative_to(adapter).as_posix()}")
        fs.pipe_file(f"{root}/{READY_MARKER}", b"")  # last: readers trust only marked versions

    def retire(self, model: str, keep_steps: set[int]) -> list[int]:
        """Delete the published versions of ``model`` not in ``keep_steps``."""
        deleted = []
        for step in self.published(model):
            if step in keep_steps:
                continue
            if self.is_url:
                import fsspec

                fs, root = fsspec.core.url_to_fs(f"{self.location}/{model}/{version_name(step)}")
                fs.rm(root, recursive=True)
            else:
                shutil.rmtree(self.served_path(model, step), ignore_errors=True)
            deleted.append(step)
        return deleted

    def published(self, model: str) -> list[int]:
        """The complete versions of ``model`` at the location, oldest first."""
        if self.is_url:
            import fsspec

            fs, root = fsspec.core.url_to_fs(f"{self.location}/{model}")
            names = [Path(p).name for p in fs.ls(root, detail=False)] if fs.exists(root) else []
            names = [n for n in names
                     if fs.exists(f"{root}/{n}/{READY_MARKER}")]
        else:
            folder = self.served_root / model if self.served_root else None
            names = [p.name for p in folder.iterdir()] if folder and folder.is_dir() else []
        steps = [int(n.removeprefix("policy@")) for n in names
                 if n.startswith("policy@") and n.removeprefix("policy@").isdigit()]
        return sorted(steps)
