"""Group-relative advantages: each trajectory's reward against its group's (GRPO)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class GroupAdvantages:
    advantages: list[float]
    skipped: bool


def group_advantages(rewards: list[float], scale: bool, eps: float = 1e-4) -> GroupAdvantages:
    """Mean-centred (and, if ``scale``, std-scaled) rewards; a zero-variance group is skipped."""
    n = len(rewards)
    mean = sum(rewards) / n
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / n)
    if n < 2 or std < 1e-8:
        return GroupAdvantages([0.0] * n, skipped=True)
    return GroupAdvantages([(r - mean) / (std + eps) if scale else r - mean for r in rewards],
                           skipped=False)
