"""ART 0.5.23's tokenized views of trajectories (``TokenizedHistory``, ``TokenizedTrajectory``,
``TokenizedMultiHistoryTrajectory``, ``TokenizedTrajectoryGroup``, ``TokenFlag``), with ART's
fields: per token its id, sampling logprob (NaN where none) and flags.

They hold what the trainer would train on (:mod:`tracerl.backend.training.rows`): one history per
training row, built from the ids the gateway recorded (flagged ``EXACT``; sampled ones
``EXACT | SAMPLED | ASSISTANT | OUTPUT``), and only for a trajectory without token records
rendered with the chat template (no ``EXACT`` flag).
"""

from __future__ import annotations

from enum import IntFlag
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import pydantic

from ..core.trajectory import History, TrajectoryGroup
from .views import OfTrajectory, Tokenized

if TYPE_CHECKING:
    import torch

    from .tensors import (
        TensorizedHistory,
        TensorizedMultiHistoryTrajectory,
        TensorizedTrajectory,
        TensorizedTrajectoryGroup,
    )


class TokenFlag(IntFlag):
    """Independent facts about a token (ART's bits, combinable)."""

    EXACT = 1 << 0  # the id came from the engine, not from tokenizing text here
    SAMPLED = 1 << 1  # the engine sampled this id (implies EXACT | OUTPUT)
    ASSISTANT = 1 << 2  # in an assistant turn
    STOP = 1 << 3  # the token that ended a generation
    OUTPUT = 1 << 4  # from a concrete response
    RAW_LOGPROBS = 1 << 5
    PROCESSED_LOGPROBS = 1 << 6


class TokenizedHistory(Tokenized):
    """One token sequence: ``tokens``, ``logprobs`` and ``flags`` of equal length."""

    history: History
    model: str
    tokens: list[int]
    logprobs: list[float]
    flags: list[TokenFlag]

    @pydantic.model_validator(mode="after")
    def _lengths_match(self) -> TokenizedHistory:
        if not len(self.tokens) == len(self.logprobs) == len(self.flags):
            raise ValueError(f"tokens ({len(self.tokens)}), logprobs ({len(self.logprobs)}) and "
                             f"flags ({len(self.flags)}) differ in length")
        return self

    def tensorize(self, *, device: torch.device | str | None = None) -> TensorizedHistory:
        from .tensors import tensorize_history

        return tensorize_history(self, device=device)


class TokenizedTrajectory(TokenizedHistory, OfTrajectory):
    """A trajectory of one history, tokenized."""

    def tensorize(self, *, device: torch.device | str | None = None) -> TensorizedTrajectory:
        from .tensors import tensorize_trajectory

        return tensorize_trajectory(self, device=device)


class TokenizedMultiHistoryTrajectory(OfTrajectory):
    """A trajectory of several histories (subagents, edited histories: several rows)."""

    histories: list[TokenizedHistory]

    def tensorize(self, *,
                  device: torch.device | str | None = None) -> TensorizedMultiHistoryTrajectory:
        from .tensors import tensorize_multi_history

        return tensorize_multi_history(self, device=device)


TokenizedT = TypeVar("TokenizedT", TokenizedTrajectory, TokenizedMultiHistoryTrajectory)


class TokenizedTrajectoryGroup(Tokenized, Generic[TokenizedT]):
    """A group's trajectories tokenized, in order; the group (its exceptions too) kept."""

    trajectory_group: TrajectoryGroup
    trajectories: list[TokenizedT]

    @property
    def metrics(self) -> dict[str, float]:
        return self.trajectory_group.metrics

    @metrics.setter
    def metrics(self, value: dict[str, float]) -> None:
        self.trajectory_group.metrics = value

    @property
    def metadata(self) -> dict[str, Any]:
        return self.trajectory_group.metadata

    @metadata.setter
    def metadata(self, value: dict[str, Any]) -> None:
        self.trajectory_group.metadata = value

    def tensorize(self, *, device: torch.device | str | None = None) -> TensorizedTrajectoryGroup:
        from .tensors import tensorize_group

        return tensorize_group(self, device=device)


__all__ = ["TokenFlag", "TokenizedHistory", "TokenizedMultiHistoryTrajectory",
           "TokenizedTrajectory", "TokenizedTrajectoryGroup"]
