"""A server-side plugin for the online-mode tests: inverts the rewards of the online batches of
the steps named in ``TRACERL_TEST_INVERT_STEPS`` (comma-separated), so that the candidate
trained on them really learns the wrong thing (rewards in [0, 1]: ``1 - reward``).

Loaded with ``tracerl serve --plugin tests.online_bad_candidate_plugin``."""

from __future__ import annotations

import os

import tracerl


def _steps() -> set[int]:
    return {int(s) for s in os.environ.get("TRACERL_TEST_INVERT_STEPS", "").split(",") if s}


@tracerl.hookimpl
def tracerl_online_batch(model, step, groups):
    if step in _steps():
        for group in groups:
            for trajectory in group.trajectories:
                trajectory.reward = 1.0 - trajectory.reward
