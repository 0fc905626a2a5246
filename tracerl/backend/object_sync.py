"""A model's folder copied to and from object storage (S3 and whatever else fsspec opens), so
that training resumes on another machine: push checkpoints, history and records; pull them into
a fresh backend folder; the next step is the one after the newest pulled checkpoint.

The layout is ART's (``s3://BUCKET/[PREFIX/]PROJECT/models/NAME/...``), so ART's
``LocalBackend._experimental_push_to_s3`` / ``_experimental_pull_from_s3`` (``backend/local.py``)
read and write the same objects. Credentials and endpoints come from fsspec's usual sources
(``AWS_*`` variables, ``~/.aws``) or ``storage_options``.

Checkpoints are written once and never change, so one already on the other side is not copied
again; a pulled checkpoint appears whole or not at all (``atomic_directory``), and every other
file is replaced atomically. Temporary names (a leading dot) are never copied.
"""

from __future__ import annotations

import logging
import re
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from ..core import settings
from ..core.errors import ConfigError
from ..core.storage import ModelStore, atomic_directory, atomic_write_bytes

log = logging.getLogger(__name__)

# what a pull may leave out (ART's ``ExcludableOption``)
EXCLUDABLE = ("checkpoints", "logs", "trajectories")
_STEP_DIR = re.compile(r"^\d{4,}$")


@dataclass
class SyncResult:
    """What one push or pull copied and removed (paths relative to the model's folder)."""

    copied: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)


def model_url(store: ModelStore, *, bucket: str | None = None, prefix: str | None = None,
              scheme: str = "s3") -> str:
    """Where ``store``'s model lives in object storage: ART's path under ``bucket`` (default:
    the ``BACKUP_BUCKET`` environment variable, as in ART)."""
    bucket = bucket or settings.BACKUP_BUCKET.get()
    if not bucket:
        raise ConfigError("s3_bucket: no bucket given and BACKUP_BUCKET is not set")
    if "/" in bucket.strip("/") or bucket.startswith(("s3:", "gs:", "file:")):
        raise ConfigError(f"s3_bucket: {bucket!r} is not a bucket name (no scheme, no '/')")
    prefix_part = f"{prefix.strip('/')}/" if prefix and prefix.strip("/") else ""
    return f"{scheme}://{bucket.strip('/')}/{prefix_part}{store.project}/models/{store.name}"


def _filesystem(url: str, storage_options: dict[str, Any] | None) -> tuple[Any, str]:
    import fsspec

    # no instance cache: a listing cached by an earlier call would hide newer objects
    fs, root = fsspec.core.url_to_fs(url, skip_instance_cache=True, **(storage_options or {}))
    return fs, root.rstrip("/")


def _copied(relative: str) -> bool:
    """Whether a file of the model's folder travels (temporary files and folders do not)."""
    return not any(part.startswith(".") for part in PurePosixPath(relative).parts)


def _is_checkpoint_file(relative: str) -> bool:
    parts = PurePosixPath(relative).parts
    return len(parts) >= 3 and parts[0] == "checkpoints" and bool(_STEP_DIR.match(parts[1]))


def _local_files(root: Path) -> dict[str, int]:
    """Files under ``root`` that travel, relative POSIX path -> size."""
    if not root.is_dir():
        return {}
    return {p.relative_to(root).as_posix(): p.stat().st_size for p in root.rglob("*")
            if p.is_file() and _copied(p.relative_to(root).as_posix())}


def _remote_files(fs: Any, root: str) -> dict[str, int]:
    if not fs.exists(root):
        return {}
    found = fs.find(root, detail=True)
    out = {}
    for path, info in found.items():
        relative = PurePosixPath(path).relative_to(root).as_posix()
        if info.get("type", "file") == "file" and _copied(relative):
            out[relative] = int(info.get("size") or 0)
    return out


def _push_order(relative: str) -> tuple[int, str]:
    """Checkpoints first, the history line that names them last: a reader that pulls mid-push
    sees no history of a checkpoint that is not there yet."""
    if _is_checkpoint_file(relative):
        return 0, relative
    return (2 if relative == "history.jsonl" else 1), relative


def push(store: ModelStore, url: str, *, delete: bool = False,
         storage_options: dict[str, Any] | None = None) -> SyncResult:
    """Copy ``store``'s folder to ``url`` (creating the bucket when it does not exist). A
    checkpoint file already there with the same size is not copied again; ``delete`` removes
    objects under ``url`` that are not in the local folder."""
    local = _local_files(store.root)
    if not local:
        raise ConfigError(f"nothing to push: {store.root} holds no files of model "
                          f"{store.project}/{store.name}")
    fs, root = _filesystem(url, storage_options)
    bucket = root.split("/", 1)[0]
    if getattr(fs, "protocol", None) and "s3" in fs.protocol and not fs.exists(bucket):
        fs.mkdir(bucket)
    remote = _remote_files(fs, root)
    result = SyncResult()
    for relative in sorted(local, key=_push_order):
        if _is_checkpoint_file(relative) and remote.get(relative) == local[relative]:
            result.skipped.append(relative)
            continue
        fs.put_file(str(store.root / relative), f"{root}/{relative}")
        result.copied.append(relative)
    if delete:
        gone = sorted(set(remote) - set(local))
        if gone:
            fs.rm([f"{root}/{r}" for r in gone])
        result.deleted = gone
    log.info("pushed %s to %s: %d files copied, %d already there, %d removed", store.root, url,
             len(result.copied), len(result.skipped), len(result.deleted))
    return result


def _checkpoint_step(relative: str) -> int:
    return int(PurePosixPath(relative).parts[1])


def _wanted(relative: str, exclude: set[str], steps: set[int] | None) -> bool:
    top = PurePosixPath(relative).parts[0]
    if top in exclude:
        return False
    return not (_is_checkpoint_file(relative) and steps is not None
                and _checkpoint_step(relative) not in steps)


def pull(store: ModelStore, url: str, *, only_step: int | Literal["latest"] | None = None,
         exclude: Iterable[str] = (), delete: bool = False,
         storage_options: dict[str, Any] | None = None) -> SyncResult:
    """Copy the model at ``url`` into ``store``'s folder. ``only_step`` (a step, or
    ``"latest"``) pulls that one checkpoint instead of all; ``exclude`` leaves out any of
    ``checkpoints``, ``logs``, ``trajectories``; ``delete`` removes local files (of what was
    pulled) that are not at ``url``. A checkpoint already here is kept as it is. An empty
    bucket or prefix copies nothing (logged), as ART's ``aws s3 sync``; a missing bucket is an
    error naming it."""
    exclude = set(exclude)
    unknown = exclude - set(EXCLUDABLE)
    if unknown:
        raise ConfigError(f"exclude: unknown parts {sorted(unknown)} (choose from {EXCLUDABLE})")
    if only_step is not None and only_step != "latest" and (
            isinstance(only_step, bool) or not isinstance(only_step, int) or only_step < 1):
        raise ConfigError(f"only_step: {only_step!r} is neither a step (>= 1) nor 'latest'")
    fs, root = _filesystem(url, storage_options)
    bucket = root.split("/", 1)[0]
    if getattr(fs, "protocol", None) and "s3" in fs.protocol and not fs.exists(bucket):
        raise ConfigError(f"s3_bucket: bucket {bucket!r} does not exist (nothing was pulled)")
    remote = _remote_files(fs, root)
    if not remote:  # as ART's `aws s3 sync`: a fresh model starts from its base
        log.info("nothing to pull: no objects under %s; %s keeps what it has", url, store.root)
        return SyncResult()
    remote_steps = sorted({_checkpoint_step(r) for r in remote if _is_checkpoint_file(r)})
    steps: set[int] | None = None
    if only_step == "latest":
        steps = set(remote_steps[-1:])
    elif only_step is not None:
        if only_step not in remote_steps:
            raise ConfigError(f"only_step: {url} has no checkpoint {only_step} "
                              f"(checkpoints: {remote_steps})")
        steps = {only_step}
    wanted = {r: size for r, size in remote.items() if _wanted(r, exclude, steps)}
    result = SyncResult()
    by_step: dict[int, list[str]] = {}
    for relative in sorted(wanted):
        if _is_checkpoint_file(relative):
            by_step.setdefault(_checkpoint_step(relative), []).append(relative)
            continue
        atomic_write_bytes(store.root / relative, fs.cat_file(f"{root}/{relative}"))
        result.copied.append(relative)
    for step, files in sorted(by_step.items()):
        if store.checkpoint_dir(step).is_dir():  # written once: the copy here is the same
            result.skipped.extend(files)
            continue
        with atomic_directory(store.checkpoint_dir(step)) as tmp:
            for relative in files:
                inside = Path(*PurePosixPath(relative).parts[2:])
                (tmp / inside).parent.mkdir(parents=True, exist_ok=True)
                fs.get_file(f"{root}/{relative}", str(tmp / inside))
        result.copied.extend(files)
    if delete:
        pulled_tops = {PurePosixPath(r).parts[0] for r in wanted} | {"history.jsonl"}
        local = _local_files(store.root)
        gone = sorted(r for r in set(local) - set(remote)
                      if PurePosixPath(r).parts[0] in pulled_tops
                      and not (steps is not None and _is_checkpoint_file(r)))
        for step in sorted({_checkpoint_step(r) for r in gone if _is_checkpoint_file(r)}):
            shutil.rmtree(store.checkpoint_dir(step))  # a checkpoint goes whole
        for relative in gone:
            if not _is_checkpoint_file(relative):
                (store.root / relative).unlink()
        result.deleted = gone
    log.info("pulled %s into %s: %d files copied, %d already here, %d removed", url, store.root,
             len(result.copied), len(result.skipped), len(result.deleted))
    return result
