"""Per-turn credit for multi-turn rollouts (GiGPO: Feng et al., 2025, "Group-in-Group Policy
Optimization for LLM Agent Training"): each turn's tokens get their episode's advantage plus a
step-level one, from the turns of the group's rollouts that share the turn's state.

    A(i, t)   = A_E(i) + w * A_S(i, t)                      (``turn_weight`` = w)
    A_E(i)    = trajectory i's reward against its group's   (GRPO, as per-rollout credit)
    G(i, t)   = sum over k >= t of gamma^(k-t) * r(i, k)     (``turn_discount`` = gamma)
    A_S(i, t) = G(i, t) against the G of every turn of the group with the same state

Both comparisons are mean-centred, and std-scaled when ``scale_rewards`` (GiGPO's
``mean_std_norm``; off is its ``mean_norm``); a state no other turn shares, or whose returns are
all equal, gives ``A_S = 0``. A turn is an answered call of the rollout (no error, a
completion), in time order. Its rewards ``r(i, k)`` are ``metadata["turn_rewards"]`` (one
number per turn) where the task gives them, else 0 at every turn but the last, which gets the
trajectory's reward (GiGPO's sparse case: ``G(i, t) = gamma^(T-1-t) * reward``). The state of a
turn (``turn_state``) is its prompt's tokens (the whole history so far), its latest observation
(the request's messages after its last assistant message: GiGPO's anchor state) or its position
in the rollout; ``metadata["turn_states"]`` (one string per turn) names it instead.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from ...core.config import TrainConfig
from ...core.errors import InvalidTrajectoryError
from ...core.trajectory import LLMCall, Trajectory, TrajectoryGroup
from .advantages import group_advantages

TURN_REWARDS = "turn_rewards"  # Trajectory.metadata key: one reward per turn
TURN_STATES = "turn_states"    # Trajectory.metadata key: one state name per turn


@dataclass
class GroupCredit:
    """A group's advantages: one per trajectory (``episode``), and with per-turn credit one
    per turn, by call id (``turns[i]``, the token-level advantage of that call's tokens)."""

    episode: list[float]
    turns: list[dict[str, float]] | None = None
    skipped: bool = False
    # per-turn credit: turns, states shared by several turns, turns in such states
    n_turns: int = 0
    step_groups: int = 0
    grouped_turns: int = 0
    step_advantages: list[float] = field(default_factory=list)  # w * A_S of every turn


def turns_of(trajectory: Trajectory) -> list[LLMCall]:
    """The rollout's turns: its answered calls (no error, a completion), in time order."""
    return sorted((c for c in trajectory.llm_calls if not c.error and c.completions),
                  key=lambda c: c.created_at)


def discounted_returns(rewards: list[float], gamma: float) -> list[float]:
    """``G(t) = r(t) + gamma * G(t + 1)``, from the last turn back."""
    out, running = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        running = rewards[t] + gamma * running
        out[t] = running
    return out


def _metadata_list(trajectory: Trajectory, key: str, n: int, where: str) -> list[Any] | None:
    value = trajectory.metadata.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != n:
        got = f"{len(value)} entries" if isinstance(value, list) else type(value).__name__
        raise InvalidTrajectoryError(
            f"{where}.metadata[{key!r}]: one entry per turn (answered call) is needed, {n} "
            f"here; got {got}")
    return value


def turn_rewards(trajectory: Trajectory, n: int, where: str) -> list[float]:
    """``metadata["turn_rewards"]`` (checked: ``n`` finite numbers), else the sparse case: 0 at
    every turn but the last, which gets the trajectory's reward."""
    given = _metadata_list(trajectory, TURN_REWARDS, n, where)
    if given is None:
        return [0.0] * (n - 1) + [trajectory.reward] if n else []
    for k, r in enumerate(given):
        if isinstance(r, bool) or not isinstance(r, int | float) or not math.isfinite(r):
            raise InvalidTrajectoryError(
                f"{where}.metadata[{TURN_REWARDS!r}][{k}]: {r!r} is not a finite number")
    return [float(r) for r in given]


def state_key(call: LLMCall, mode: str, position: int) -> Hashable:
    """The state a turn acted in, as ``turn_state`` reads it (see the module's docstring)."""
    if mode == "position":
        return position
    messages = call.request.get("messages")
    if mode == "observation" and isinstance(messages, list):
        last = max((i for i, m in enumerate(messages)
                    if isinstance(m, dict) and m.get("role") == "assistant"), default=-1)
        return json.dumps(messages[last + 1:], sort_keys=True, default=str)
    if call.prompt_token_ids:
        return tuple(call.prompt_token_ids)
    return json.dumps(call.request.get("messages", call.request.get("prompt")),
                      sort_keys=True, default=str)


def turn_states(trajectory: Trajectory, turns: list[LLMCall], mode: str, where: str
                ) -> list[Hashable]:
    """Each turn's state: ``metadata["turn_states"]`` (strings) where given, else by ``mode``."""
    given = _metadata_list(trajectory, TURN_STATES, len(turns), where)
    if given is None:
        return [state_key(call, mode, k) for k, call in enumerate(turns)]
    for k, s in enumerate(given):
        if not isinstance(s, str):
            raise InvalidTrajectoryError(
                f"{where}.metadata[{TURN_STATES!r}][{k}]: {s!r} is not a string")
    return [("named", s) for s in given]


def check_turn_metadata(trajectory: Trajectory, where: str) -> None:
    """Raise :class:`InvalidTrajectoryError` naming a ``turn_rewards`` or ``turn_states``
    entry that is not one number (string) per turn."""
    turns = turns_of(trajectory)
    turn_rewards(trajectory, len(turns), where)
    turn_states(trajectory, turns, "position", where)


def step_advantages(returns: dict[tuple[int, int], float], states: dict[tuple[int, int], Hashable],
                    scale: bool) -> tuple[dict[tuple[int, int], float], list[int]]:
    """``A_S`` of every turn ``(trajectory, turn)``: its return against those of the turns in
    the same state (0 for a state of one turn, or of equal returns); and the size of each
    state's group."""
    by_state: dict[Hashable, list[tuple[int, int]]] = defaultdict(list)
    for key, state in states.items():
        by_state[state].append(key)
    out: dict[tuple[int, int], float] = {}
    for members in by_state.values():
        adv = group_advantages([returns[m] for m in members], scale)
        out.update(zip(members, adv.advantages, strict=True))
    return out, [len(m) for m in by_state.values()]


def group_credit(group: TrajectoryGroup, config: TrainConfig, where: str) -> GroupCredit:
    """The advantages of ``group`` under ``config.credit``; ``skipped`` when they are all 0
    (fewer than two rollouts; equal rewards and, per turn, no turn set apart either)."""
    rewards = [t.reward for t in group.trajectories]
    if len(rewards) < 2:
        return GroupCredit([0.0] * len(rewards), skipped=True)
    episode = group_advantages(rewards, config.scale_rewards)
    if config.credit == "rollout":
        return GroupCredit(episode.advantages, skipped=episode.skipped)
    turns = [turns_of(t) for t in group.trajectories]
    returns: dict[tuple[int, int], float] = {}
    states: dict[tuple[int, int], Hashable] = {}
    for i, (trajectory, calls) in enumerate(zip(group.trajectories, turns, strict=True)):
        at = f"{where}.trajectories[{i}]"
        g = discounted_returns(turn_rewards(trajectory, len(calls), at), config.turn_discount)
        for k, state in enumerate(turn_states(trajectory, calls, config.turn_state, at)):
            returns[(i, k)], states[(i, k)] = g[k], state
    a_step, sizes = step_advantages(returns, states, config.scale_rewards)
    w = config.turn_weight
    per_turn = [{call.id: episode.advantages[i] + w * a_step[(i, k)]
                 for k, call in enumerate(calls)} for i, calls in enumerate(turns)]
    signal = not episode.skipped or any(abs(a) > 1e-8 for a in a_step.values())
    return GroupCredit(episode.advantages, per_turn, skipped=not signal,
                       n_turns=len(returns), step_groups=sum(s > 1 for s in sizes),
                       grouped_turns=sum(s for s in sizes if s > 1),
                       step_advantages=[w * a for a in a_step.values()])
