"""Writes every kind of file of a model into a folder that runs out of space, then again after
space is back; prints what happened as JSON. Run as a subprocess by tests/test_faults_storage.py:

    python -m tests.faults_disk_writer FOLDER rlimit   # RLIMIT_FSIZE (ulimit -f): EFBIG
    python -m tests.faults_disk_writer FOLDER fill     # FOLDER is a small tmpfs, filled: ENOSPC

The limit is set inside this process only (Python ignores SIGXFSZ, so writes raise EFBIG)."""

from __future__ import annotations

import errno
import json
import os
import resource
import sys
from collections.abc import Callable
from pathlib import Path

import tracerl
from tracerl.backend.gateway.recorder import CallStore
from tracerl.core.errors import TracerlError
from tracerl.core.storage import ModelStore, atomic_directory
from tracerl.core.trajectory import LLMCall, write_groups_jsonl

BIG = 64 * 1024


def group() -> tracerl.TrajectoryGroup:
    return tracerl.TrajectoryGroup([tracerl.Trajectory(
        messages_and_choices=[{"role": "user", "content": "x" * BIG}], reward=1.0)])


def call(i: int) -> LLMCall:
    return LLMCall(id=f"call-{i}", rollout_id="r1", endpoint="chat.completions", model="m",
                   adapter_step=0, request={"pad": "y" * BIG * (i > 0)}, response=None,
                   prompt_token_ids=[1, 2], completions=[], temperature=1.0, streamed=False,
                   latency_s=0.1, created_at=1.0)


def checkpoint(store: ModelStore, step: int) -> None:
    with atomic_directory(store.checkpoint_dir(step)) as tmp:
        (tmp / "adapter_model.safetensors").write_bytes(b"w" * BIG * 2)


def files(store: ModelStore) -> dict[str, int]:
    return {str(p.relative_to(store.root)): p.stat().st_size
            for p in sorted(store.root.rglob("*")) if p.is_file()}


def main(folder: Path, mode: str) -> None:
    store, calls = ModelStore(folder, "faults", "disk"), CallStore()
    store.write_definition({"name": "disk"})
    store.log_history(1, "train", {"loss": 1.0})
    checkpoint(store, 1)
    calls.add(store, call(0))
    before = files(store)
    filler = folder / "filler"
    if mode == "rlimit":
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (store.history_path.stat().st_size + 10, hard))
    else:  # fill the tmpfs to the last byte
        with open(filler, "wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"\0" * 4096)
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
    writes: dict[str, Callable[[], None]] = {
        "history": lambda: store.log_history(2, "train", {f"m{i}": 0.5 for i in range(4000)}),
        "call record": lambda: calls.add(store, call(1)),
        "trajectories": lambda: write_groups_jsonl(store.trajectories_path("train", 2), [group()]),
        "checkpoint": lambda: checkpoint(store, 2),
        "marker": lambda: store.write_definition({"name": "disk", "pad": "z" * BIG}),
    }
    results = {}
    for what, write in writes.items():
        try:
            write()
            results[what] = {"error": None}
        except TracerlError as e:
            results[what] = {"error": e.code, "type": type(e).__name__, "message": str(e)}
    during = files(store)
    if mode == "rlimit":
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    else:
        filler.unlink()
    store.log_history(2, "train", {"loss": 0.5})
    calls.add(store, call(2))
    checkpoint(store, 2)
    print(json.dumps({
        "results": results, "unchanged": before == during, "before": before, "during": during,
        "history": [h["step"] for h in store.history()],
        "calls": [c.id for c in calls.take(store, "r1")],
        "checkpoints": store.checkpoint_steps(),
        "left_over": sorted(p.name for p in store.root.rglob(".*")),
    }))


if __name__ == "__main__":
    os.umask(0o022)
    main(Path(sys.argv[1]), sys.argv[2])
