"""One GRPO step for several models at once (``backend.train_many``): each model's groups are
saved as its next step, the models on one shared base train their rows in shared passes (the
one update, :func:`~.update.optimize`, that a single model's step runs too), then each model is
checkpointed, logged and published on its own, exactly as :func:`~.step.train_step` does for
one model.

A model whose checkpoint or publish fails is reported, and every other model of the step still
finishes; a failed update fails the step of every model in it (none is checkpointed, each
trains its saved groups again: ``backend.pending_groups``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from ...core.backend import TrainEvent
from ...core.config import TrainConfig
from ...core.errors import StepsFailedError
from ...core.metrics import summarize_groups
from ...core.storage import ModelStore
from ...core.trajectory import TrajectoryGroup
from ...core.watchdog import watch
from . import health
from .policy import Policy
from .step import Serving, finish_step, heartbeats, own_calls, save_step_groups, step_rows
from .update import optimize

log = logging.getLogger(__name__)


@dataclass
class ModelStep:
    """One model's part of a multi-model step."""

    key: str
    step: int
    groups: list[TrajectoryGroup]
    store: ModelStore
    serving: Serving
    policy: Policy | None = field(default=None, repr=False)


def grpo_update_many(parts: list[ModelStep], config: TrainConfig) -> list[dict[str, float]]:
    """Rows of each model's groups, then one optimizer step of each model, the rows of models
    sharing a base (one peft model) in shared forward/backward passes. Returns each model's
    metrics."""
    metrics, rows, policies = [], [], []
    for part in parts:
        assert part.policy is not None
        own, m = step_rows(part.policy, part.groups, config)
        rows.append(own)
        policies.append(part.policy)
        metrics.append(m if own else {**m, "skipped": 1.0, "loss": 0.0})
    by_base: dict[int, list[int]] = {}
    for i, policy in enumerate(policies):
        if rows[i]:
            by_base.setdefault(id(policy.model), []).append(i)
    for indices in by_base.values():
        trained = optimize([policies[i] for i in indices], [rows[i] for i in indices], config)
        for i, m in zip(indices, trained, strict=True):
            metrics[i].update(m)
            health.write_token_logprobs(parts[i].store, parts[i].step, rows[i])
    return metrics


async def train_many_step(parts: list[ModelStep], config: TrainConfig, *,
                          load_policies: Callable[[], list[Policy]],
                          heartbeat_s: float = 30.0) -> AsyncIterator[tuple[str, TrainEvent]]:
    """Train each of ``parts`` (distinct models) one step; yields ``(model key, event)``."""
    for part in parts:  # 1. every model's groups are on disk before anything trains on them
        part.groups = own_calls(part.store, part.groups)  # each model trains its own calls
        save_step_groups(part.store, part.step, part.groups)
        part.store.recover()
    for part in parts:
        yield part.key, TrainEvent("started", part.step)
    started = time.perf_counter()
    first = parts[0].step
    phase = ["putting the engines to sleep"]
    awake: list[Serving] = []
    with watch("train", f"a step of {len(parts)} models", lambda: phase[0]):
        try:
            for part in parts:
                await part.serving.sleep()
                awake.append(part.serving)
            phase[0] = "loading the policies"
            for part, policy in zip(parts, await asyncio.to_thread(load_policies), strict=True):
                part.policy = policy
            phase[0] = "the update (a worker thread)"
            work = asyncio.ensure_future(asyncio.to_thread(grpo_update_many, parts, config))
            async for event in heartbeats(work, first, started, heartbeat_s):
                for part in parts:
                    yield part.key, TrainEvent("heartbeat", part.step,
                                               elapsed_s=event.elapsed_s)
            results = work.result()
        finally:
            phase[0] = "waking the engines"
            for serving in reversed(awake):
                await serving.wake_up()
    seconds = time.perf_counter() - started
    failed: dict[str, BaseException] = {}
    for part, metrics in zip(parts, results, strict=True):
        metrics = {**summarize_groups(part.groups), **health.stray_calls(part.store, part.groups),
                   **metrics, "seconds": seconds, "models_in_step": float(len(parts))}
        assert part.policy is not None
        try:
            await finish_step(part.step, part.policy, metrics, store=part.store,
                              serving=part.serving)
        except Exception as e:  # the others still finish; this one trains its groups again
            log.exception("step %d of %s failed after the update", part.step, part.key)
            failed[part.key] = e
            continue
        yield part.key, TrainEvent("done", part.step, metrics=metrics)
    if failed:
        raise StepsFailedError(failed)
