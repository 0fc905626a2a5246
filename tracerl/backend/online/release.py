"""Release control: a trained version moves shadow -> canary -> promoted (or rolled back), each
stage's evidence in the model's release log (:mod:`tracerl.core.release_log`).

- **propose**: version ``N`` is loaded beside the incumbent as ``NAME@N``; plain ``NAME`` calls
  still get the incumbent (a training step under release control only loads its version);
- **shadow**: a held-out set of scenarios (messages, and whatever the scorer reads) is replayed
  on the candidate and on the incumbent through the gateway, each reply scored; the gates
  (:mod:`.gates`) judge the two arms; a candidate that fails is rejected;
- **canary**: ``share`` of new rollouts, chosen by a sticky hash of the rollout id
  (:func:`~tracerl.backend.gateway.served.canary_bucket`: a rollout's every call goes to the
  same version), is served by the candidate; :meth:`ReleaseControl.evaluate` takes the rewards
  that came back, splits them by the version that served each rollout (the recorded
  ``adapter_step``, fingerprint-checked) and asks the gates: promote, roll back (the candidate
  is rejected; the incumbent never changed), hold (the canary stops; a person decides), or
  continue;
- **promote / rollback**: ``begin`` record, the version loaded, ``commit`` record, then routed:
  calls in flight finish on the version they started on, new ones get the new incumbent, so
  no request is dropped; ``tracerl promote MODEL N`` / ``tracerl rollback MODEL --to N`` do
  the same through ``tracerl serve``'s control API.

A restart (even after kill -9) serves the last committed incumbent
(:func:`~tracerl.backend.gateway.releases.attach`). The steps the gateway takes (attach, load,
move the incumbent) are :mod:`tracerl.backend.gateway.releases`'; the routing they set is the
served model's (:class:`~tracerl.backend.gateway.served.ReleaseRouting`). Release control
talks to the backend through :class:`.seam.ReleaseBackend`.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from ...core.errors import ConfigError
from ...core.fingerprint import check_calls
from ...core.model_name import ModelName
from ...core.release_log import ReleaseLog, ReleaseState
from ...core.storage import append_jsonl
from ...core.trajectory import LLMCall
from ..gateway.releases import attach, load_candidate, move_incumbent
from ..gateway.served import ReleaseRouting, ServedModel, canary_bucket
from ..training.health import CLAIMED
from .gates import Gates, Verdict, arm_evidence, judge
from .seam import ReleaseBackend

# canary_bucket, attach and move_incumbent: where callers imported them from before
__all__ = ["ReleaseControl", "Scorer", "attach", "canary_bucket", "move_incumbent"]

log = logging.getLogger(__name__)

Scorer = Callable[[dict[str, Any], str], float | Awaitable[float]]


class ReleaseControl:
    """Drive one model's releases on a backend (a :class:`~tracerl.backend.local.LocalBackend`:
    the caller's, or ``tracerl serve``'s)."""

    def __init__(self, backend: ReleaseBackend, model: Any, gates: Gates | None = None
                 ) -> None:
        from ...core.model_spec import spec_of

        self.backend, self.spec = backend, spec_of(model)
        self.gates = gates or Gates()

    @property
    def route(self) -> ServedModel:
        return self.backend.served(self.spec)

    @property
    def log(self) -> ReleaseLog:
        return ReleaseLog(self.route.store.root)

    def state(self) -> ReleaseState:
        return self.log.state()

    async def enable(self) -> ReleaseState:
        """Put the model under release control (see
        :func:`~tracerl.backend.gateway.releases.attach`)."""
        return await self.backend.call_on_gateway(attach(self.route))

    async def propose(self, step: int) -> None:
        """Load checkpoint ``step`` as the candidate (no traffic yet)."""
        route = self.route
        incumbent = await self.backend.call_on_gateway(load_candidate(route, step))
        await asyncio.to_thread(self.log.append, "candidate", step=step, incumbent=incumbent)
        route.release = ReleaseRouting(incumbent, step, 0.0)

    async def shadow(self, scenarios: Sequence[dict[str, Any]], scorer: Scorer, *,
                     max_tokens: int = 64, temperature: float = 0.0) -> Verdict:
        """Replay ``scenarios`` (each a dict with ``messages``) on the candidate and the
        incumbent through the gateway, score each reply with ``scorer(scenario, text)`` and
        judge; a candidate the gates refuse (rollback or hold) is rejected."""
        from openai import AsyncOpenAI

        release = self._candidate_routing()
        assert release.candidate is not None
        steps = (release.candidate, release.incumbent)
        rewards: dict[int, list[float]] = {s: [] for s in steps}
        calls: dict[int, list[LLMCall]] = {s: [] for s in steps}
        name, ids = self.backend.inference_name(self.spec), []
        async with AsyncOpenAI(base_url=self.backend.base_url,
                               api_key=self.backend.api_key or "tracerl-local") as client:
            for i, scenario in enumerate(scenarios):
                for step in steps:
                    rid = f"shadow-{uuid.uuid4().hex[:12]}-{i}"
                    ids.append(rid)
                    response = await client.chat.completions.create(
                        model=str(ModelName.of(name, step)), messages=scenario["messages"],
                        max_tokens=max_tokens, temperature=temperature,
                        extra_headers={"x-rollout-id": rid})
                    score = scorer(scenario, response.choices[0].message.content or "")
                    if isinstance(score, Awaitable):
                        score = await score
                    rewards[step].append(float(score))
                    calls[step] += await self.backend.fetch_calls(self.spec, rid)
        store = self.route.store  # replayed calls are no orphans
        await asyncio.to_thread(append_jsonl, store.root / "calls" / CLAIMED, {"rollout_ids": ids})
        gates = Gates(**{**self.gates.__dict__,
                         "min_samples": min(self.gates.min_samples, len(scenarios))})
        verdict = judge(arm_evidence(calls[release.candidate], rewards[release.candidate]),
                        arm_evidence(calls[release.incumbent], rewards[release.incumbent]), gates)
        ok = verdict.decision in ("promote", "continue")
        await asyncio.to_thread(self.log.append, "shadow", step=release.candidate,
                                verdict="pass" if ok else "fail", tripped=verdict.tripped,
                                evidence=verdict.evidence)
        if not ok:
            await self.reject(release.candidate, f"shadow: {'; '.join(verdict.tripped)}")
        return verdict

    async def start_canary(self, share: float) -> None:
        """Route ``share`` of new rollouts (0 < share <= 1) to the candidate."""
        if not isinstance(share, int | float) or not 0 < share <= 1:
            raise ConfigError(f"canary share must be in (0, 1], not {share!r}")
        release = self._candidate_routing()
        await asyncio.to_thread(self.log.append, "canary", step=release.candidate,
                                share=float(share))
        self.route.release = ReleaseRouting(release.incumbent, release.candidate, float(share))

    async def evaluate(self, rewards: Mapping[str, float], *, act: bool = True) -> Verdict:
        """Judge the canary on ``rewards`` (rollout id -> reward): each rollout counts for the
        version its recorded calls claim (calls whose fingerprint does not match are left
        out). ``act``: promote, reject (roll back) or hold as the verdict says."""
        release = self._candidate_routing()
        assert release.candidate is not None
        arms: dict[int, tuple[list[LLMCall], list[float]]] = {
            release.candidate: ([], []), release.incumbent: ([], [])}
        for rid, reward in rewards.items():
            recorded = await self.backend.fetch_calls(self.spec, rid)
            refused = check_calls(self.route.store.checkpoints_dir, recorded).refused
            good = [c for c in recorded if c.id not in refused and c.adapter_step in arms]
            steps = {c.adapter_step for c in good}
            if len(steps) != 1:  # unserved, refused, or served by both (a promotion between)
                continue
            arm = arms[steps.pop()]  # type: ignore[index]
            arm[0].extend(good)
            arm[1].append(float(reward))
        cand, inc = (arm_evidence(*arms[release.candidate]),
                     arm_evidence(*arms[release.incumbent]))
        verdict = judge(cand, inc, self.gates)
        await asyncio.to_thread(self.log.append, "gate", step=release.candidate,
                                verdict=verdict.decision, tripped=verdict.tripped,
                                evidence=verdict.evidence)
        if act:
            await self._act(release.candidate, verdict)
        return verdict

    async def _act(self, step: int, verdict: Verdict) -> None:
        if verdict.decision == "promote":
            await self.promote(step, reason="gates passed")
        elif verdict.decision == "rollback":
            await self.reject(step, "; ".join(verdict.tripped))
        elif verdict.decision == "hold":  # (the gate record says so: the canary stops)
            release = self._candidate_routing()
            self.route.release = ReleaseRouting(release.incumbent, step, 0.0)

    async def promote(self, step: int, reason: str = "by hand") -> ReleaseState:
        return await self.backend.call_on_gateway(
            move_incumbent(self.route, "promote", step, reason=reason))

    async def rollback(self, to: int, reason: str = "by hand") -> ReleaseState:
        return await self.backend.call_on_gateway(
            move_incumbent(self.route, "rollback", to, reason=reason))

    async def reject(self, step: int, reason: str) -> None:
        """The candidate goes (the incumbent never changed): recorded, routed away."""
        release = self._candidate_routing()
        await asyncio.to_thread(self.log.append, "rejected", step=step, reason=reason)
        self.route.release = ReleaseRouting(release.incumbent)
        log.warning("%s: candidate %d rolled back: %s", self.route.key, step, reason)

    def _candidate_routing(self) -> ReleaseRouting:
        release = self.route.release
        if release is None or release.candidate is None:
            raise ConfigError(f"{self.spec.key} has no candidate in release: propose one first")
        return release
