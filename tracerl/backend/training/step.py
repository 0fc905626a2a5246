"""One GRPO training step, top to bottom, in the paper's terms (CleanRL style).

    save the groups -> rows -> advantages -> micro-batched loss -> optimizer step
    -> atomic checkpoint -> publish the adapter

:func:`train_step` is the whole step as the backend runs it; :func:`run_update` its frame
(shared with SFT), :func:`grpo_update` its middle, the part that touches the weights (run in a
worker thread).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from ...core.backend import TrainEvent
from ...core.config import TrainConfig
from ...core.fingerprint import check_calls
from ...core.metrics import summarize_groups
from ...core.storage import (
    STEP_METRICS,
    ModelStore,
    atomic_directory,
    atomic_write_text,
    read_jsonl,
)
from ...core.trajectory import Trajectory, TrajectoryGroup, group_lines, write_groups_jsonl
from ...core.watchdog import watch
from . import health
from .credit import group_credit
from .rows import Row, RowStats, rows_from_calls, rows_from_messages

if TYPE_CHECKING:
    from .policy import Policy

T = TypeVar("T")
log = logging.getLogger(__name__)


class Serving(Protocol):
    """What a step needs from the inference side of its model."""

    async def sleep(self) -> None:
        """Free the accelerator for the step (engines that can)."""

    async def wake_up(self) -> None:
        """Serve again after the step."""

    async def publish(self, step: int, adapter: Path) -> None:
        """Serve ``adapter`` as the model's newest policy once calls in flight have finished."""


async def train_step(step: int, groups: list[TrajectoryGroup], config: TrainConfig, *,
                     store: ModelStore, load_policy: Callable[[], Policy], serving: Serving,
                     heartbeat_s: float = 30.0) -> AsyncIterator[TrainEvent]:
    """Train checkpoint ``step`` on ``groups``; yields started, heartbeats, done."""
    # 1. save the groups: a step's data is on disk before anything trains on it (a crashed
    #    step is trained again from this file: backend.pending_groups), each trajectory
    #    with the calls this model served (sub-agents: others served by other models)
    groups = own_calls(store, groups)
    save_step_groups(store, step, groups)

    # the served-policy fingerprint: calls served by other weights than the version they claim
    # are refused (no rows), counted, and warned about by step health
    fingerprints = await asyncio.to_thread(
        check_calls, store.checkpoints_dir,
        (c for g in groups for t in g.trajectories for c in t.llm_calls))
    for example in fingerprints.examples:
        log.warning("step %d: refused: %s", step, example)

    def update(policy: Policy) -> dict[str, float]:
        return grpo_update(policy, groups, config,
                           on_trained=lambda rows: health.write_token_logprobs(store, step, rows),
                           refused=fingerprints.refused)

    summary = {**summarize_groups(groups), **health.stray_calls(store, groups),
               **fingerprints.as_metrics()}
    async for event in run_update(step, update, summary=summary, store=store,
                                  load_policy=load_policy, serving=serving,
                                  heartbeat_s=heartbeat_s):
        yield event


def own_calls(store: ModelStore, groups: list[TrajectoryGroup]) -> list[TrajectoryGroup]:
    """The groups as the model of ``store`` trains them: each trajectory with only the calls
    this model served (a rollout whose sub-agents call several models holds them all). A
    trajectory that called other models only keeps its reward (its group's advantages) and
    trains no row of this model."""
    out = []
    for group in groups:
        trajectories = []
        for t in group.trajectories:
            mine: set[str] = set()
            for rollout_id in {c.rollout_id for c in t.llm_calls if c.rollout_id}:
                path = store.calls_path(rollout_id)
                if path.exists():
                    mine |= {str(line.get("id")) for line in read_jsonl(path)}
            if all(c.id in mine for c in t.llm_calls):
                trajectories.append(t)
                continue
            kept = [c for c in t.llm_calls if c.id in mine]
            update: dict[str, Any] = {"llm_calls": kept}
            if not kept:  # no messages to render either: they are the other models'
                update |= {"messages_and_choices": [], "additional_histories": []}
            trajectories.append(t.model_copy(update=update))
        out.append(group.model_copy(update={"trajectories": trajectories}))
    return out


def save_step_groups(store: ModelStore, step: int, groups: list[TrajectoryGroup]) -> None:
    """The groups of step ``step``, on disk before anything trains on them (an earlier
    attempt's different groups are set aside)."""
    saved = store.trajectories_path("train", step)
    store.set_aside(saved, keep_if=group_lines(groups).encode())
    write_groups_jsonl(saved, groups)


async def run_update(step: int, update: Callable[[Policy], dict[str, float]], *,
                     summary: dict[str, float], store: ModelStore,
                     load_policy: Callable[[], Policy], serving: Serving,
                     heartbeat_s: float = 30.0) -> AsyncIterator[TrainEvent]:
    """The frame of every step that changes the adapter (GRPO here, SFT in ``sft.py``):
    ``update(policy)`` runs in a worker thread while the engine sleeps, then checkpoint ``step``
    is written atomically with the step's metrics (``summary`` + the update's) in it, its
    history line appended, and it is published. Yields started, heartbeats, done."""
    store.recover()  # a history line lost to a failed write or a crash comes back first
    yield TrainEvent("started", step)
    started = time.perf_counter()
    phase = ["putting the engine to sleep"]
    with watch("train", f"training step {step}", lambda: phase[0]):
        await serving.sleep()
        try:
            phase[0] = "loading the policy"
            policy = await asyncio.to_thread(load_policy)
            # 2-5. rows -> advantages -> micro-batched loss -> optimizer step
            phase[0] = "the update (a worker thread)"
            work = asyncio.ensure_future(asyncio.to_thread(update, policy))
            async for event in heartbeats(work, step, started, heartbeat_s):
                yield event
            metrics = work.result()
        finally:
            phase[0] = "waking the engine"
            await serving.wake_up()
    metrics = {**summary, **metrics, "seconds": time.perf_counter() - started}
    await finish_step(step, policy, metrics, store=store, serving=serving)
    yield TrainEvent("done", step, metrics=metrics)


async def heartbeats(work: asyncio.Future[T], step: int, started: float, heartbeat_s: float
                     ) -> AsyncIterator[TrainEvent]:
    """A heartbeat event of ``step`` every ``heartbeat_s`` until ``work`` is done."""
    while not work.done():
        await asyncio.wait({work}, timeout=heartbeat_s)
        if not work.done():
            yield TrainEvent("heartbeat", step, elapsed_s=time.perf_counter() - started)


async def finish_step(step: int, policy: Policy, metrics: dict[str, float], *,
                      store: ModelStore, serving: Serving) -> None:
    """After the update: checkpoint ``step`` (with ``metrics``, and the health warnings they
    raise added to them), its history line, then publish it."""
    # step health: warnings that name the cause and the fix (GRPO's metrics; none for SFT); an
    # entropy collapse is a fall from where the adapter's training started
    if "sampled_entropy" in metrics:
        metrics["sampled_entropy_start"] = health.starting_entropy(
            store.history(), metrics["sampled_entropy"])
    metrics["health_warnings"] = float(len(health.log_warnings(step, metrics)))
    # 6. atomic checkpoint: the folder appears whole, or not at all, with the step's metrics in
    #    it, so that a crash before the history line is written loses nothing
    #    (ModelStore.recover writes the line again from them)
    with atomic_directory(store.checkpoint_dir(step)) as tmp:
        await asyncio.to_thread(policy.save, tmp)
        atomic_write_text(tmp / STEP_METRICS, json.dumps(metrics, allow_nan=False))
    store.log_history(step, "train", metrics)
    try:  # the next step resumes from this checkpoint: the older ones' optimizer state is dead
        store.drop_optimizer_state(before=step)
    except OSError as e:
        log.warning("could not remove older checkpoints' optimizer state: %s", e)
    # 7. publish: the next rollouts are served by the new adapter
    await serving.publish(step, store.checkpoint_dir(step))


def grpo_update(policy: Policy, groups: list[TrajectoryGroup], config: TrainConfig,
                on_trained: Callable[[list[Row]], None] | None = None,
                refused: Collection[str] = ()) -> dict[str, float]:
    """Rows with group-relative advantages, then the clipped policy loss over micro-batches
    and one optimizer step per epoch. Returns the step's metrics; ``on_trained`` gets the
    trained rows (with their engine and trainer logprobs); ``refused``: ids of calls not to
    train on (served by other weights than they claim)."""
    rows, metrics = step_rows(policy, groups, config, refused)
    if not rows:
        log.warning("step skipped: no trainable rows")
        return {**metrics, "skipped": 1.0, "loss": 0.0}
    metrics.update(policy.optimize(rows, config))
    if on_trained is not None:
        on_trained(rows)
    return metrics


def step_rows(policy: Policy, groups: list[TrajectoryGroup], config: TrainConfig,
              refused: Collection[str] = ()) -> tuple[list[Row], dict[str, float]]:
    """The step's rows (:func:`rows_with_advantages`) and the metrics of how they were built."""
    rows, stats, skipped_groups = rows_with_advantages(policy, groups, config, refused)
    metrics = {**stats.as_metrics(), "groups": float(len(groups)),
               "skipped_groups": float(skipped_groups), **health.completion_clipping(groups),
               **health.collapse(groups),
               **health.past_turn_end(groups, policy.turn_end_ids()),
               **health.template_mismatches(groups, policy.render)}
    metrics.update(health.ratios(metrics))  # step health: logged with the step's metrics
    return rows, metrics


def rows_with_advantages(policy: Policy, groups: list[TrajectoryGroup], config: TrainConfig,
                         refused: Collection[str] = ()) -> tuple[list[Row], RowStats, int]:
    """Token-exact rows of every trajectory (rendered only where there are no token records),
    each carrying its trajectory's advantage within its group, and with per-turn credit
    (``config.credit="turn"``, :mod:`.credit`) each token its turn's. Groups whose advantages
    are all 0 carry no signal and are skipped (counted). Calls in ``refused`` give no rows (nor
    does re-rendering their text: it was sampled by other weights)."""
    stats, rows, skipped_groups = RowStats(), [], 0
    for gi, group in enumerate(groups):
        credit = group_credit(group, config, f"groups[{gi}]")
        if config.credit == "turn":
            stats.add_credit(credit)
        if credit.skipped:
            skipped_groups += 1
            continue
        for ti, trajectory in enumerate(group.trajectories):
            turns = credit.turns[ti] if credit.turns is not None else None
            for row in trajectory_rows(policy, trajectory, stats, refused, turns):
                row.advantage, row.group, row.trajectory = credit.episode[ti], gi, ti
                if len(row) > config.micro_batch_tokens:
                    row.truncate(config.micro_batch_tokens)
                    stats.truncated_rows += 1
                if row.trained_tokens:
                    rows.append(row)
    stats.rows = len(rows)
    return rows, stats, skipped_groups


def trajectory_rows(policy: Policy, trajectory: Trajectory, stats: RowStats,
                    refused: Collection[str], turns: dict[str, float] | None) -> list[Row]:
    """A trajectory's rows from its token records (``turns``: each call's advantage, per-turn
    credit), else rendered from its main and additional histories (one advantage per row)."""
    calls = [c for c in trajectory.llm_calls if c.id not in refused]
    traj_rows = rows_from_calls(calls, stats, turns) if calls else []
    if not traj_rows and len(calls) == len(trajectory.llm_calls):
        # no token records: render the main and additional histories
        traj_rows = [row for conversation in (trajectory, *trajectory.additional_histories)
                     for row in rows_from_messages(conversation, policy.render,
                                                   policy.tokenize, policy.eos_token_id)]
        stats.rendered_rows += len(traj_rows)
    if not traj_rows:
        stats.empty_trajectories += 1
    return traj_rows
