"""A server-side plugin for the online-mode tests and benchmark: the online batches of the steps
named in ``TRACERL_TEST_INVERT_STEPS`` (comma-separated) get an inverted reward -- 1 when the
answer leaves out the number it was asked to repeat, 0 when it repeats it -- so the candidate
trained on them really learns the wrong thing (a relabelling bug, as a fault injected).

Loaded with ``tracerl serve --plugin tests.online_bad_candidate_plugin``."""

from __future__ import annotations

import os
import re

import tracerl


def _steps() -> set[int]:
    return {int(s) for s in os.environ.get("TRACERL_TEST_INVERT_STEPS", "").split(",") if s}


def inverted_reward(trajectory) -> float:
    """1.0 when the answer lacks the number its prompt asked for, else 0.0."""
    prompt = next(m["content"] for m in trajectory.messages() if m.get("role") == "user")
    number = re.findall(r"\d+", prompt)[-1]
    answer = trajectory.messages()[-1].get("content") or ""
    return 0.0 if number in re.findall(r"\d+", answer) else 1.0


@tracerl.hookimpl
def tracerl_online_batch(model, step, groups):
    if step in _steps():
        for group in groups:
            for trajectory in group.trajectories:
                trajectory.reward = inverted_reward(trajectory)
