"""Moved to :mod:`tracerl.events.lifecycle`; this import path stays for code written before."""

from ..events.lifecycle import (
    llm_call_recorded,
    rollout_started,
    score_group,
    step_logged,
    train_event,
    trajectory_finished,
)

__all__ = ["llm_call_recorded", "rollout_started", "score_group", "step_logged", "train_event",
           "trajectory_finished"]
