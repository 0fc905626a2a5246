"""Online mode: learn from live traffic, safely (``tracerl serve --online``, or
:class:`OnlineLoop` on your own :class:`~tracerl.backend.local.LocalBackend`).

One loop per model, on the gateway's event loop. Each tick:

1. **expire** (:meth:`.live_calls.LiveCalls.expire`): waiting live calls served by a version
   that was rolled back; older than ``reward_ttl_s``; the oldest beyond ``max_pending``.
   Rollout-API rollouts still open after ``reward_ttl_s`` are finished as failed. A full
   group whose rewards are all equal (``equal_rewards_tolerance``: no GRPO signal, DAPO's
   dynamic sampling) expires too, so that no step learns nothing and no such candidate takes
   up a canary. Counted;
2. a candidate in **canary**: once ``evaluate_every`` new rewards came back for calls served
   since the canary started, the gates judge it (:meth:`.release.ReleaseControl.evaluate`):
   promote, roll back, hold (``on_hold``: rejected, or a person decides with ``tracerl
   promote`` / ``rollback``) or wait;
3. no candidate: when ``groups_per_step`` groups are ready -- ``group_size`` rewarded live
   calls with one task key and a spread of rewards each, topped up with finished rollout-API
   groups -- they are taken
   (one fsynced event), ``tracerl_online_batch`` fires, the step trains **from the incumbent**
   (a rolled-back candidate's weights are never trained on), and the new version is proposed
   and put in canary for ``canary_share`` of new calls.

Every decision is in the model's release log and live-call log, both append-only; a restart
(even after kill -9) goes on from them: the same batch id retakes the same groups, a proposed
candidate goes to canary, the incumbent is the last committed one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from ...core import settings
from ...core.config import OnlineConfig
from ...core.errors import ConfigError, StorageError, TrainingError
from ...core.model_spec import ModelSpec, spec_of
from ...core.release_log import ReleaseState
from ...events.lifecycle import online_batch, train_event
from ..gateway.rollout_api import build_groups
from .batches import FailedBatches
from .gates import Gates, Verdict
from .live_calls import live_rollout_id
from .release import ReleaseControl
from .seam import OnlineBackend

if TYPE_CHECKING:
    from ...core.storage import ModelStore
    from .live_calls import LiveCalls

log = logging.getLogger(__name__)


def online_config(raw: str | dict[str, Any] | OnlineConfig | None) -> OnlineConfig:
    """An :class:`OnlineConfig` from a JSON object (``tracerl serve --online-config``), its
    gates checked too; a ConfigError naming the field that is wrong."""
    try:
        config = raw if isinstance(raw, OnlineConfig) else \
            OnlineConfig.model_validate_json(raw) if isinstance(raw, str) else \
            OnlineConfig.model_validate(raw or {})
    except ValueError as e:
        raise ConfigError(f"invalid online config: {e}") from None
    known = {f.name for f in fields(Gates)}
    unknown = set(config.gates) - known
    if unknown:
        raise ConfigError(f"invalid online config: gates: unknown {sorted(unknown)}; known: "
                          f"{sorted(known)}")
    return config


class OnlineLoop:
    """Online mode for one registered model of a backend (:class:`.seam.OnlineBackend`: a
    :class:`~tracerl.backend.local.LocalBackend`)."""

    def __init__(self, backend: OnlineBackend, model: Any, config: OnlineConfig | None = None
                 ) -> None:
        self.backend, self.spec = backend, spec_of(model)
        self.config = online_config(config)
        gates: dict[str, Any] = dict(self.config.gates)
        self.control = ReleaseControl(backend, self.spec, Gates(**gates))
        self.last_verdict: Verdict | None = None
        self.trained: list[int] = []
        self.expired_rollouts = 0
        self._evaluated_at = 0  # canary rewards counted at the last gate evaluation
        self._started = False
        self.batches = FailedBatches(self.store, spec_of(model).key)

    @property
    def store(self) -> ModelStore:
        return self.backend.store(self.spec)

    @property
    def live(self) -> LiveCalls:
        return self.backend.live_calls

    async def start(self) -> ReleaseState:
        """Put the model under release control and in online mode (idempotent)."""
        state = await self.control.enable()
        await asyncio.to_thread(self.live.enable, self.store)
        self.control.route.live = live_rollout_id  # a plain call: a live rollout of its own
        if state.candidate is not None and state.stage == "shadow":  # proposed, then a crash
            await self.control.start_canary(self.config.canary_share)
        self._started = True
        log.info("%s: online mode on (incumbent %s)", self.spec.key, state.incumbent)
        return self.control.state()

    async def run(self, stop: asyncio.Event) -> None:
        """Tick every ``poll_s`` until ``stop`` is set; a failing tick is logged and retried."""
        while not stop.is_set():
            try:
                await self.tick()
            except Exception:
                log.exception("%s: online tick failed; retrying in %.1f s", self.spec.key,
                              self.config.poll_s)
            try:
                await asyncio.wait_for(stop.wait(), self.config.poll_s)
            except TimeoutError:
                pass

    async def tick(self) -> str:
        """One round (see the module's doc); returns what it did."""
        if not self._started:
            if self.control.route.unavailable is not None:
                return "unavailable"  # (logged once, by attach) until a promote serves one
            await self.start()
        state = self.control.state()
        await self._expire(state)
        if state.candidate is not None:
            if state.stage != "canary":
                return "held"  # a person decides: tracerl promote / rollback
            return await self._judge(state)
        return await self._train()

    async def _expire(self, state: ReleaseState) -> None:
        cfg, store = self.config, self.store
        ttl = cfg.reward_ttl_s or settings.TRACERL_ONLINE_REWARD_TTL_S.get()
        keep = {int(h["step"]) for h in state.history} | (
            {state.candidate} if state.candidate is not None else set())
        await asyncio.to_thread(
            self.live.expire, store, ttl_s=ttl, keep_steps=keep,
            max_pending=cfg.max_pending or settings.TRACERL_ONLINE_MAX_PENDING.get())
        if cfg.equal_rewards_tolerance is not None:
            await asyncio.to_thread(self.live.expire_equal_groups, store, cfg.group_size,
                                    cfg.equal_rewards_tolerance)
        if cfg.rollout_api:
            gone = await asyncio.to_thread(self.backend.rollouts.expire_open, store,
                                           time.time() - ttl)
            self.expired_rollouts += len(gone)

    def _canary_since(self, step: int) -> float:
        records = [r for r in self.control.log.records()
                   if r.get("event") == "canary" and r.get("step") == step]
        return float(records[-1]["time"]) if records else time.time()

    async def _judge(self, state: ReleaseState) -> str:
        assert state.candidate is not None
        rewards = await asyncio.to_thread(self.live.rewards_since, self.store,
                                          self._canary_since(state.candidate))
        if len(rewards) < self._evaluated_at + self.config.evaluate_every:
            return "canary"
        self._evaluated_at = len(rewards)
        verdict = await self.control.evaluate(rewards)
        self.last_verdict = verdict
        log.info("%s: candidate %d on %d canary rewards: %s %s", self.spec.key, state.candidate,
                 len(rewards), verdict.decision, "; ".join(verdict.tripped))
        if verdict.decision == "hold" and self.config.on_hold == "reject":
            await self.control.reject(state.candidate, "held: " + "; ".join(verdict.tripped))
        if verdict.decision != "continue":
            self._evaluated_at = 0
        return verdict.decision

    async def _train(self) -> str:
        cfg, store, spec = self.config, self.store, self.spec
        step = store.latest_step() + 1
        batch = await asyncio.to_thread(self.batches.next_id, step)
        live_ready = await asyncio.to_thread(self.live.ready, store, cfg.group_size,
                                             cfg.equal_rewards_tolerance)
        api_ready = self.backend.rollouts.counts(store)["ready_groups"] \
            if cfg.rollout_api else 0
        if not self.live.has_batch(store, batch) and \
                live_ready + api_ready < cfg.groups_per_step:
            return "collecting"
        started: list[bool] = []
        try:
            groups = await self._take(batch)
            incumbent = self.control.state().incumbent
            assert incumbent is not None
            if store.latest_step() != incumbent:  # never train on from a rolled-back candidate
                await self.backend.train_from(spec, incumbent)
            await online_batch(spec, step, groups)
            trained = await self._train_step(spec, groups, started)
        except Exception as e:
            if not started and isinstance(e, TrainingError | StorageError):
                raise  # the backend busy, a full disk: not the batch's fault; tried again
            if not await asyncio.to_thread(self.batches.failed, batch, e, cfg.batch_tries):
                raise  # logged by run(); tried again next tick
            return "set aside"
        self.trained.append(trained)
        await self.control.propose(trained)
        await self.control.start_canary(cfg.canary_share)
        self._evaluated_at = 0
        log.info("%s: trained %d from %d groups (from version %d); in canary for %.0f%% of "
                 "new calls", spec.key, trained, len(groups), incumbent, 100 * cfg.canary_share)
        return "trained"

    async def _take(self, batch: str) -> list[Any]:
        """The groups of ``batch``: live ones, topped up from the rollout API (a batch taken
        before: the same groups again)."""
        cfg, store = self.config, self.store
        taken = await asyncio.to_thread(self.live.take, store, cfg.groups_per_step,
                                        cfg.group_size, batch, cfg.equal_rewards_tolerance)
        groups = await asyncio.to_thread(build_groups, taken, store, self.backend.call_store,
                                         self.backend.rollouts)
        missing = cfg.groups_per_step - len(groups)
        if missing and cfg.rollout_api:
            groups += await self.backend.take_external_groups(self.spec, missing, batch)
        return groups

    async def _train_step(self, spec: ModelSpec, groups: list[Any], started: list[bool]
                          ) -> int:
        step = 0
        async for event in self.backend.train_events(spec, groups, self.config.train):
            started.append(True)
            await train_event(spec, event, groups, self.config.train)  # the server's plugins
            if event.kind == "done":
                step = event.step
        return step

    def status(self) -> dict[str, Any]:
        """The counts of live calls (the expired ones by reason), the release state, and the
        last gate verdict."""
        state = self.control.state()
        verdict = self.last_verdict
        return {"model": self.spec.key, **self.live.counts(self.store),
                "expired_rollout_api": self.expired_rollouts,
                "ready_groups": self.live.ready(self.store, self.config.group_size,
                                                self.config.equal_rewards_tolerance),
                "incumbent": state.incumbent, "candidate": state.candidate,
                "stage": state.stage, "trained_steps": self.trained,
                **self.batches.status(),
                "last_verdict": None if verdict is None else {
                    "decision": verdict.decision, "tripped": verdict.tripped}}
