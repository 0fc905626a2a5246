"""Training requests of a server: one step at a time, idempotent by request id, resumable.

A request id names one training step. Sending it again attaches to the step while it runs,
returns its result once it has finished, and, after a crash of the server, trains the step
again from the trajectories saved before the crash. The id's state is kept on disk in
``{model}/requests/train/{id}.json`` (written before training starts and after it ends), so a
restarted server knows it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core.config import TrainConfig
from ..core.errors import (
    ConfigError,
    QueueFullError,
    StorageError,
    TrainConflictError,
    code_of,
)
from ..core.model_spec import ModelSpec
from ..core.storage import ModelStore, atomic_write_text, validate_name
from ..core.trajectory import TrajectoryGroup, read_groups_jsonl
from ..events.lifecycle import train_event

log = logging.getLogger(__name__)


@dataclass
class TrainJob:
    """One training step requested by id; its events are what a client is streamed."""

    request_id: str
    model_key: str
    step: int | None = None
    state: str = "queued"  # queued, running, done, failed
    metrics: dict[str, float] | None = None
    error: dict[str, str] | None = None
    started_at: float | None = None
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)

    async def set(self, **changes: Any) -> None:
        async with self.changed:
            for k, v in changes.items():
                setattr(self, k, v)
            self.changed.notify_all()

    @property
    def finished(self) -> bool:
        return self.state in ("done", "failed")


def request_marker(store: ModelStore, kind: str, request_id: Any) -> Path:
    """Where the state of a client's request (``kind`` 'train' or 'log') is kept."""
    if not isinstance(request_id, str):
        raise ConfigError("the parameters line needs a request_id (a client-chosen id)")
    return store.root / "requests" / kind / f"{validate_name('request id', request_id)}.json"


def _write_marker(store: ModelStore, job: TrainJob) -> None:
    record = {"request_id": job.request_id, "step": job.step, "state": job.state,
              "metrics": job.metrics, "error": job.error, "time": time.time()}
    atomic_write_text(
        request_marker(store, "train", job.request_id), json.dumps(record, allow_nan=False)
    )


class TrainQueue:
    """Runs training steps one after another (one accelerator), at most ``max_queued`` waiting."""

    def __init__(self, backend: Any, *, max_queued: int = 4, heartbeat_s: float = 5.0,
                 keep_finished: int = 256) -> None:
        self.backend = backend
        self.max_queued = max_queued
        self.heartbeat_s = heartbeat_s
        self.keep_finished = keep_finished
        self._slot = asyncio.Lock()
        self._jobs: dict[tuple[str, str], TrainJob] = {}
        self._tasks: set[asyncio.Task] = set()

    def _active_job(self, model_key: str) -> TrainJob | None:
        return next((j for j in self._jobs.values()
                     if j.model_key == model_key and not j.finished), None)

    def queued(self) -> int:
        return sum(1 for j in self._jobs.values() if j.state == "queued")

    def status(self) -> list[dict[str, Any]]:
        return [{"request_id": j.request_id, "model": j.model_key, "step": j.step, "state": j.state}
                for j in self._jobs.values() if not j.finished]

    def submit(self, model: ModelSpec, request_id: Any, groups: list[TrajectoryGroup],
               config: TrainConfig) -> TrainJob:
        """The job of ``request_id``: the running or finished one, a resumed one, or a new one."""
        store: ModelStore = self.backend.store(model)
        marker = request_marker(store, "train", request_id)  # validates the id
        key = model.key
        if (key, request_id) in self._jobs:
            return self._jobs[key, request_id]
        job = TrainJob(request_id=request_id, model_key=key)
        if marker.exists():
            saved = json.loads(marker.read_text())
            job.step = saved["step"]
            if saved["state"] in ("done", "failed"):
                job.state, job.metrics, job.error = saved["state"], saved["metrics"], saved["error"]
                return self._remember(job)
            if job.step in store.checkpoint_steps():  # crashed after the checkpoint was saved
                job.state, job.metrics = "done", store.train_metrics(job.step)
                _write_marker(store, job)
                return self._remember(job)
            if store.latest_step() != job.step - 1:
                raise TrainConflictError(
                    f"request {request_id} was step {job.step}, but the model is at step "
                    f"{store.latest_step()}; send the groups again with a new request id")
            saved_groups = store.trajectories_path("train", job.step)
            if saved_groups.exists():  # the trajectories written before the crash are the truth
                groups = read_groups_jsonl(saved_groups)
        active = self._active_job(key)
        if active is not None:
            raise TrainConflictError(
                f"model {key} already has training request {active.request_id} {active.state} "
                f"(step {active.step or 'not yet assigned'}); wait for it, or send that id "
                "again to follow it"
            )
        if self.queued() >= self.max_queued:
            raise QueueFullError(f"{self.queued()} training requests are already waiting "
                                 f"(limit {self.max_queued}); retry later")
        self._remember(job)
        task = asyncio.create_task(self._run(job, model, store, groups, config))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return job

    def _remember(self, job: TrainJob) -> TrainJob:
        self._jobs[job.model_key, job.request_id] = job
        finished = [k for k, j in self._jobs.items() if j.finished]
        for k in finished[: max(len(finished) - self.keep_finished, 0)]:
            del self._jobs[k]
        return job

    async def _run(self, job: TrainJob, model: ModelSpec, store: ModelStore,
                   groups: list[TrajectoryGroup], config: TrainConfig) -> None:
        """Train the job's step. Whatever fails (the disk, the step, a plugin), the job ends
        failed or done and the slot is freed: the queue never wedges."""
        async with self._slot:
            try:
                step = store.latest_step() + 1
                await job.set(state="running", step=step, started_at=time.monotonic())
                _write_marker(store, job)
                metrics: dict[str, float] = {}
                async for event in self.backend.train_events(model, groups, config):
                    await train_event(model, event, groups, config)  # the server's plugins
                    if event.kind == "done":
                        metrics = event.metrics
            except Exception as e:
                log.warning("training request %s of %s failed: %s", job.request_id,
                            job.model_key, e)
                await job.set(state="failed", error={
                    "type": type(e).__name__, "code": code_of(e), "message": str(e)})
            else:
                await job.set(state="done", metrics=metrics)
            try:
                _write_marker(store, job)
            except StorageError as e:  # the step's own state is on disk (checkpoint, history)
                log.error("could not record the end of training request %s: %s",
                          job.request_id, e)

    async def events(self, job: TrainJob) -> AsyncIterator[dict[str, Any]]:
        """What a client following ``job`` is told: accepted, started, heartbeats, the end."""
        yield {"event": "accepted", "request_id": job.request_id, "state": job.state,
               "queued_before": self.queued() - 1 if job.state == "queued" else 0}
        told_started = False
        while True:
            async with job.changed:
                if not job.finished and (job.state != "running" or told_started):
                    try:
                        await asyncio.wait_for(job.changed.wait(), self.heartbeat_s)
                    except TimeoutError:
                        pass
            if job.state in ("running", "done", "failed") and not told_started:
                told_started = True
                yield {"event": "started", "step": job.step}
            if job.state == "done":
                yield {"event": "done", "step": job.step, "metrics": job.metrics or {}}
                return
            if job.state == "failed":
                yield {"event": "error", "step": job.step, **(job.error or {})}
                return
            elapsed = time.monotonic() - job.started_at if job.started_at else 0.0
            yield {
                "event": "heartbeat",
                "state": job.state,
                "step": job.step,
                "elapsed_s": round(elapsed, 3),
            }

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
