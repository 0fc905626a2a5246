"""Training on rollouts that run outside this process: a service (in any language) opens them
on the gateway's rollout API (``POST /v1/rollouts``), calls the model, and finishes them with
their rewards; :func:`gather_external_groups` hands the finished groups to the trainer.

The outside service draws its groups itself, so dynamic sampling cannot draw more for it: with
``dynamic_sampling``, a handed-out group with equal rewards is set aside and the next ready
groups are taken in its place, as long as the service keeps finishing groups, until the bound.
What was set aside is told back: the result's ``sampling`` report names the rollout-API groups
(``report.discarded``, each with ``metadata["group"]``), ``model.train(groups)`` returns the
``sampling/...`` counts and logs them under the ``sampling`` split, so the service's loop can
open more groups, or easier/harder ones, for the next step.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import cast

from ..core.config import DynamicSampling
from ..core.errors import RolloutTimeoutError
from ..core.model_spec import spec_of
from ..core.trajectory import TrajectoryGroup
from .model import Model
from .sampling import Bound, SamplingReport, step_groups

POLL_S = 0.5


async def gather_external_groups(model: Model, n_groups: int, *, timeout_s: float = 600.0,
                                 dynamic_sampling: DynamicSampling | None = None
                                 ) -> list[TrajectoryGroup]:
    """Wait until ``n_groups`` groups of rollouts opened and finished by an outside service
    (the gateway's ``/v1/rollouts`` API) are ready, and return them as trajectory groups with
    their recorded calls, spans, rewards and metrics, ready for ``model.train``.

    Each rollout is handed out once, even across restarts of the trainer or the backend (the
    backend keeps the cursor). Raises :class:`RolloutTimeoutError`, saying how many rollouts
    are open and finished, when they are not ready within ``timeout_s``.

    ``dynamic_sampling`` (off by default): groups with equal rewards are set aside and further
    ready groups taken instead, one at a time, until ``n_groups`` have signal or the bound is
    hit (``max_draw_factor * n_groups`` taken; ``max_seconds``, else ``timeout_s``, spent
    waiting); the result is then a :class:`~.sampling.SampledGroups` whose report names the
    groups set aside."""
    groups = await _take(model, n_groups, "take-" + uuid.uuid4().hex, timeout_s)
    if dynamic_sampling is None:
        return groups
    report = SamplingReport(n_groups, dynamic_sampling)  # n_groups is the ask here
    deadline = report.started + (dynamic_sampling.max_seconds or timeout_s)
    report.drawn = len(groups)
    kept = [g for g in groups if report.judge(g)]
    request_id, bound = "take-" + uuid.uuid4().hex, cast(Bound | None, None)
    while len(kept) < n_groups and bound is None:
        if report.drawn >= report.limit:
            bound = "draws"
        elif (taken := await model.backend.take_external_groups(model, 1, request_id)):
            request_id = "take-" + uuid.uuid4().hex  # the next take is a new request
            report.drawn += len(taken)
            kept += [g for g in taken if report.judge(g)]
        elif time.monotonic() >= deadline:
            bound = "time"
        else:
            await asyncio.sleep(POLL_S)
    report.finish(bound)
    return step_groups(kept, report)


async def _take(model: Model, n_groups: int, request_id: str, timeout_s: float
                ) -> list[TrajectoryGroup]:
    """``n_groups`` ready groups, polled for under one ``request_id`` (retries are safe)."""
    backend = model.backend
    deadline = time.monotonic() + timeout_s
    while True:
        groups = await backend.take_external_groups(model, n_groups, request_id)
        if groups:
            return groups
        if time.monotonic() >= deadline:
            counts = await backend.external_rollouts_status(model)
            raise RolloutTimeoutError(
                f"waited {timeout_s:g} s for {n_groups} group(s) of rollouts finished through "
                f"the rollout API for model {spec_of(model).key}; ready groups: "
                f"{counts.get('ready_groups', 0)}, rollouts open: {counts.get('open', 0)}, "
                f"finished: {counts.get('finished', 0)}, handed out before: "
                f"{counts.get('handed_out', 0)}. The outside service must finish every rollout "
                "of a group (POST /v1/rollouts/{id}/finish); a group opened with group_size "
                "needs that many rollouts")
        await asyncio.sleep(POLL_S)
