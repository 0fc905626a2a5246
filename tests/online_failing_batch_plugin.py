"""A server-side plugin for tests/test_online_batches_kill.py: the online batches holding calls
tagged ``task: bad`` get a reward beyond the trainer's bound
(:data:`~tracerl.core.trajectory.MAX_REWARD`) -- a relabelling bug, as a fault injected -- so
that batch's training fails for real, in the trainer's row checks, on every try and after every
restart. Other batches are left alone.

Loaded with ``tracerl serve --plugin tests.online_failing_batch_plugin``."""

from __future__ import annotations

import tracerl
from tracerl.core.trajectory import MAX_REWARD


@tracerl.hookimpl
def tracerl_online_batch(model, step, groups):
    for group in groups:
        for trajectory in group.trajectories:
            if trajectory.metadata.get("task") == "task:bad":
                trajectory.reward = 10 * MAX_REWARD
