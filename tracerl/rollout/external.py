"""Training on rollouts that run outside this process: a service (in any language) opens them
on the gateway's rollout API (``POST /v1/rollouts``), calls the model, and finishes them with
their rewards; :func:`gather_external_groups` hands the finished groups to the trainer.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from ..core.errors import RolloutTimeoutError
from ..core.model_spec import spec_of
from ..core.trajectory import TrajectoryGroup
from .model import Model

POLL_S = 0.5


async def gather_external_groups(model: Model, n_groups: int, *, timeout_s: float = 600.0
                                 ) -> list[TrajectoryGroup]:
    """Wait until ``n_groups`` groups of rollouts opened and finished by an outside service
    (the gateway's ``/v1/rollouts`` API) are ready, and return them as trajectory groups with
    their recorded calls, spans, rewards and metrics, ready for ``model.train``.

    Each rollout is handed out once, even across restarts of the trainer or the backend (the
    backend keeps the cursor). Raises :class:`RolloutTimeoutError`, saying how many rollouts
    are open and finished, when they are not ready within ``timeout_s``."""
    backend = model.backend
    request_id = "take-" + uuid.uuid4().hex  # the same id on every poll: retries are safe
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
