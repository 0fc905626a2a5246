"""On-disk layout of a model and atomic file operations.

``{base}/{project}/models/{name}/``
    ``model.json``                      the model's definition
    ``history.jsonl``                   one line of metrics per logged step and split
    ``trajectories/{split}/{step:04d}.jsonl``   groups, written before training on them
    ``checkpoints/{step:04d}/``         LoRA adapters; a folder appears only when complete,
                                        with the step's train metrics in ``step_metrics.json``;
                                        the newest also holds the optimizer state
    ``calls/{rollout_id}.jsonl``        raw gateway records (backend side)
    ``calls/_unattributed.jsonl``       records of calls made without a rollout id

Faults: every write here either completes or leaves the files as they were. A failed write
(full disk, quota, ``ulimit -f``, I/O error) raises :class:`StorageError` (``DiskFullError`` for
lack of space) naming the file; a failed append is cut back off, and an append to a file that
does not end in a newline (a process killed mid-append) starts on a fresh line, so a torn line
never glues onto the next record. Readers skip a torn line wherever it is, and say so.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .errors import ConfigError, DiskFullError, InvalidTrajectoryError, StorageError

log = logging.getLogger(__name__)
_NO_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}

# the fields of a history line: a logged metric of one of these names would overwrite them
HISTORY_FIELDS = ("step", "split", "time")
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # fullmatch: no trailing newline
_CHECKPOINT_RE = re.compile(r"^\d{4,}$")
STEP_METRICS = "step_metrics.json"
OPTIMIZER_FILE = "optimizer.pt"


def validate_name(kind: str, value: object) -> str:
    """Reject names that could escape a directory or confuse a URL (``..``, ``/``, spaces...);
    ``value`` may be anything a request held (a non-string is refused too)."""
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


def storage_error(e: OSError, what: str, path: Path) -> StorageError:
    """The error of a failed write of ``what`` at ``path``: :class:`DiskFullError` for lack of
    space (ENOSPC, EDQUOT, EFBIG), else :class:`StorageError`; both name the file and errno."""
    if isinstance(e, StorageError):
        return e
    reason = os.strerror(e.errno) if e.errno else str(e)
    if e.errno in _NO_SPACE:
        return DiskFullError(e.errno or errno.ENOSPC,
                             f"could not write {what} {path}: {reason} (the disk, a quota or the "
                             "file size limit is full); nothing partial was kept")
    return StorageError(e.errno or errno.EIO, f"could not write {what} {path}: {reason}")


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` so that readers see either the old file or the whole new one."""
    atomic_write_bytes(path, text.encode())


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` so that readers see either the old file or the whole new one."""
    path = Path(path)
    tmp: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise storage_error(e, "file", path) from e
    except BaseException:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def append_jsonl(path: Path, record: dict[str, Any] | bytes) -> None:
    """Append one JSON line and fsync it: ``record`` as a dict, or already encoded as strict JSON
    (one line, no newline). The line starts on a fresh line even after a torn one (a crash
    mid-append); a failed write is cut back off, so no torn line is left behind."""
    path = Path(path)
    if isinstance(record, bytes):
        line = record + b"\n"
    else:
        line = (json.dumps(record, allow_nan=False) + "\n").encode()
    flags = os.O_RDWR | os.O_CREAT | os.O_APPEND
    try:
        try:
            fd = os.open(path, flags, 0o644)
        except FileNotFoundError:  # the first record of its folder: a stat per call saved
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, flags, 0o644)
    except OSError as e:
        raise storage_error(e, "record", path) from e
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            log.warning("%s does not end in a newline (a torn line from a crash): the next "
                        "record starts on a new line", path)
            line = b"\n" + line
        try:
            written = 0
            while written < len(line):
                written += os.write(fd, line[written:])
            os.fsync(fd)
        except OSError as e:
            try:
                os.ftruncate(fd, size)  # no torn line: the file is as it was
            except OSError:
                log.error("could not cut the torn record off %s", path)
            raise storage_error(e, "record", path) from e
    finally:
        os.close(fd)


def read_jsonl(path: Path, *, torn: list[int] | None = None) -> list[dict[str, Any]]:
    """Read a JSONL file of objects. Torn lines (a crash mid-append, a failed write of an older
    version) are skipped wherever they are, logged with their line number, and added to
    ``torn`` when given."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    except OSError as e:
        raise StorageError(e.errno or errno.EIO, f"could not read {path}: {e}") from e
    out = []
    for lineno, line in enumerate(data.split(b"\n"), 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except ValueError:  # JSONDecodeError, or bytes that are not UTF-8
            value = None
        if not isinstance(value, dict):
            log.warning("%s line %d is torn or not a JSON object (%d bytes): skipped",
                        path, lineno, len(line))
            if torn is not None:
                torn.append(lineno)
            continue
        out.append(value)
    return out


def check_history_metrics(metrics: dict[str, Any]) -> None:
    """Refuse a metric named like a history line's own field (``step``, ``split``, ``time``):
    it would overwrite the field, and the line would land at another step or split."""
    for key in HISTORY_FIELDS:
        if key in metrics:
            raise InvalidTrajectoryError(
                f"metrics[{key!r}]: {key!r} is a field of every history line "
                f"({', '.join(HISTORY_FIELDS)}); log the metric under another name")


@contextmanager
def atomic_directory(final: Path) -> Iterator[Path]:
    """Yield a temporary folder; on success it is renamed to ``final`` in one step."""
    final = Path(final)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.", suffix=".tmp"))
    except OSError as e:
        raise storage_error(e, "folder", final) from e
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
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise storage_error(e, "folder", final) from e
    except Exception as e:  # a library's writer (safetensors, torch) hides the OSError
        shutil.rmtree(tmp, ignore_errors=True)
        hidden = _hidden_os_error(e, final.parent)
        if hidden is None:
            raise
        raise storage_error(hidden, "folder", final) from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _hidden_os_error(e: Exception, folder: Path) -> OSError | None:
    """The OS error behind a library's write error: the ``(os error N)`` of Rust writers, else
    a full disk seen by ``statvfs``; None when the failure is not the disk's."""
    found = re.search(r"os error (\d+)", str(e))
    if found:
        code = int(found.group(1))
        return OSError(code, os.strerror(code))
    try:
        stat = os.statvfs(folder)
    except OSError:
        return None
    if stat.f_bavail * stat.f_frsize < 64 * 1024:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return None


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

    def set_aside(self, path: Path, keep_if: bytes) -> Path | None:
        """Move ``path`` (a recorded file about to be written again, e.g. the trajectories of a
        step that failed and is sent anew) to ``superseded/`` beside it, unless it holds
        ``keep_if`` already: recorded files are never overwritten. Returns where it went."""
        try:
            if path.read_bytes() == keep_if:
                return None
        except FileNotFoundError:
            return None
        aside = path.parent / "superseded"
        try:
            aside.mkdir(exist_ok=True)
            n = 1 + len(list(aside.glob(f"{path.stem}.*{path.suffix}")))
            target = aside / f"{path.stem}.{n}{path.suffix}"
            os.replace(path, target)
        except OSError as e:
            raise storage_error(e, "superseded file", path) from e
        log.warning("%s was recorded by an earlier attempt of the step: kept as %s", path, target)
        return target
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

    def recover(self) -> list[int]:
        """Bring the folder back into agreement after a crash: partial checkpoint folders go,
        and a checkpoint saved just before the crash gets its history line (from the metrics
        saved inside it). Returns the steps whose history line was written again."""
        self.remove_partial_checkpoints()
        logged = {h.get("step") for h in self.history() if h.get("split") == "train"}
        repaired = []
        for step in self.checkpoint_steps():
            metrics = self.checkpoint_metrics(step)
            if step not in logged and metrics is not None:
                log.warning("checkpoint %d of %s has no history line (a crash after it was "
                            "saved): written again from the checkpoint", step, self.root)
                self.log_history(step, "train", metrics)
                repaired.append(step)
        return repaired

    def checkpoint_metrics(self, step: int) -> dict[str, float] | None:
        """The train metrics saved inside checkpoint ``step`` (None for older checkpoints)."""
        path = self.checkpoint_dir(step) / STEP_METRICS
        try:
            metrics: dict[str, float] = json.loads(path.read_text())
        except (FileNotFoundError, ValueError):
            return None
        return metrics

    def train_metrics(self, step: int) -> dict[str, float]:
        """The metrics of train step ``step``: its history line, else its checkpoint's."""
        line = next((h for h in reversed(self.history())
                     if h.get("step") == step and h.get("split") == "train"), None)
        if line is not None:
            return {k: v for k, v in line.items() if k not in ("step", "split", "time")}
        return self.checkpoint_metrics(step) or {}

    def log_history(self, step: int, split: str, metrics: dict[str, float]) -> None:
        check_history_metrics(metrics)
        append_jsonl(self.history_path,
                     {"step": step, "split": split, "time": time.time(), **metrics})

    def history(self) -> list[dict[str, Any]]:
        return read_jsonl(self.history_path)

    def write_definition(self, definition: dict[str, Any]) -> None:
        atomic_write_text(self.root / "model.json", json.dumps(definition, indent=2))

    def drop_optimizer_state(self, before: int) -> list[int]:
        """Remove the optimizer state of the checkpoints older than step ``before``; return their
        steps. Training resumes from the newest checkpoint only, and Adam's state is twice the
        adapter's size, so each step would otherwise keep three adapters' worth on disk. The
        adapters themselves stay (exports, evaluation, ``delete_checkpoints``)."""
        dropped = []
        for step in self.checkpoint_steps():
            state = self.checkpoint_dir(step) / OPTIMIZER_FILE
            if step < before and state.exists():
                state.unlink(missing_ok=True)
                dropped.append(step)
        return dropped

    def delete_checkpoints(self, keep: set[int]) -> list[int]:
        """Delete every checkpoint whose step is not in ``keep``, except the newest (it is the
        model's step: deleting it would rewind the step and reuse its number); return the
        deleted steps."""
        deleted = []
        steps = self.checkpoint_steps()
        for step in steps[:-1]:
            if step not in keep:  # renamed first: a crash mid-delete leaves no half checkpoint
                doomed = self.checkpoints_dir / f".{step:04d}.deleted.tmp"
                os.replace(self.checkpoint_dir(step), doomed)
                shutil.rmtree(doomed)
                deleted.append(step)
        return deleted
