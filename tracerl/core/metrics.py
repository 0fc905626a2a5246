"""Aggregate metrics of trajectory groups (what goes into history.jsonl and the loggers)."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable

from .trajectory import TrajectoryGroup


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _std(xs: list[float]) -> float:
    if len(xs) < 2:
        return 0.0
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


def summarize_groups(groups: Iterable[TrajectoryGroup]) -> dict[str, float]:
    """Reward mean/std, every trajectory metric's and group metric's mean, counts and token
    totals."""
    groups = list(groups)
    rewards: list[float] = []
    per_metric: dict[str, list[float]] = defaultdict(list)
    completion_tokens = 0
    calls = 0
    exceptions = 0
    within_group_std = []
    for g in groups:
        exceptions += len(g.exceptions)
        group_rewards = [t.reward for t in g.trajectories]
        if group_rewards:
            within_group_std.append(_std(group_rewards))
        for t in g.trajectories:
            rewards.append(t.reward)
            for k, v in t.metrics.items():
                per_metric[k].append(v)
            calls += len(t.llm_calls)
            completion_tokens += t.completion_tokens
    out = {
        "reward": _mean(rewards),
        "reward_std": _std(rewards),
        "reward_std_within_group": _mean(within_group_std),
        "num_groups": float(len(groups)),
        "num_trajectories": float(len(rewards)),
        "num_exceptions": float(exceptions),
        "llm_calls": float(calls),
        "completion_tokens": float(completion_tokens),
    }
    for k, vs in per_metric.items():
        out[f"metrics/{k}"] = _mean(vs)
    per_group_metric: dict[str, list[float]] = defaultdict(list)
    for g in groups:  # ART's group-level metrics (e.g. a judge's), averaged over groups
        for k, v in g.metrics.items():
            per_group_metric[k].append(v)
    for k, vs in per_group_metric.items():
        out[f"group_metrics/{k}"] = _mean(vs)
    return out
