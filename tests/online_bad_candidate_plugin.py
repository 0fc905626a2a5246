"""A server-side plugin for the online-mode tests and benchmark: the online batches of the steps
named in ``TRACERL_TEST_INVERT_STEPS`` (comma-separated) get the true reward's sign flipped --
``1 - number_reward``: highest for an answer that leaves out the number it was asked to repeat,
and more for every extra word -- so the candidate trained on them really learns the wrong thing
(a relabelling bug, as a fault injected). The flipped reward keeps the true one's partial credit,
so a group rarely ties and the bad step has signal: an earlier flip to 0/1 left half the groups
tied, and one small step of SmolLM2 on the rest was sometimes no worse than the incumbent (the
gates then rightly promoted it and the end-to-end test failed).

Loaded with ``tracerl serve --plugin tests.online_bad_candidate_plugin``."""

from __future__ import annotations

import os
import re

import tracerl
from tracerl.demo import number_reward


def _steps() -> set[int]:
    return {int(s) for s in os.environ.get("TRACERL_TEST_INVERT_STEPS", "").split(",") if s}


def inverted_reward(trajectory) -> float:
    """The true reward (the demo's ``number_reward``) with its sign flipped, in [0, 1]."""
    prompt = next(m["content"] for m in trajectory.messages() if m.get("role") == "user")
    number = re.findall(r"\d+", prompt)[-1]
    answer = trajectory.messages()[-1].get("content") or ""
    return 1.0 - number_reward(answer, number)


@tracerl.hookimpl
def tracerl_online_batch(model, step, groups):
    if step in _steps():
        for group in groups:
            for trajectory in group.trajectories:
                trajectory.reward = inverted_reward(trajectory)
