"""ART 0.5.23's tensorized views: the tokenized ones with one-dimensional tensors (``tokens``
int64, ``logprobs`` float32 with NaN where none, ``flags`` int32), optionally on a device.
Importing this module loads torch; ``tracerl.trajectories`` loads it only when tensorizing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Generic, TypeVar

import pydantic
import torch

from ..core.trajectory import History, TrajectoryGroup
from .views import OfTrajectory

if TYPE_CHECKING:
    from .tokenized import (
        TokenizedHistory,
        TokenizedMultiHistoryTrajectory,
        TokenizedTrajectory,
        TokenizedTrajectoryGroup,
    )

Device = torch.device | str | None


class TensorizedHistory(pydantic.BaseModel):
    """One token sequence as tensors of equal length."""

    model_config = pydantic.ConfigDict(arbitrary_types_allowed=True)

    history: History
    model: str
    tokens: torch.Tensor
    logprobs: torch.Tensor
    flags: torch.Tensor

    @pydantic.model_validator(mode="after")
    def _lengths_match(self) -> TensorizedHistory:
        if not (self.tokens.ndim == self.logprobs.ndim == self.flags.ndim == 1
                and len(self.tokens) == len(self.logprobs) == len(self.flags)):
            raise ValueError("tokens, logprobs and flags must be one-dimensional tensors of "
                             "equal length")
        return self


class TensorizedTrajectory(TensorizedHistory, OfTrajectory):
    """A trajectory of one history, tensorized."""


class TensorizedMultiHistoryTrajectory(OfTrajectory):
    """A trajectory of several histories, each tensorized."""

    model_config = pydantic.ConfigDict(arbitrary_types_allowed=True)

    histories: list[TensorizedHistory]


TensorizedT = TypeVar("TensorizedT", TensorizedTrajectory, TensorizedMultiHistoryTrajectory)


class TensorizedTrajectoryGroup(pydantic.BaseModel, Generic[TensorizedT]):
    """A group's trajectories tensorized, in order."""

    model_config = pydantic.ConfigDict(arbitrary_types_allowed=True)

    trajectory_group: TrajectoryGroup
    trajectories: list[TensorizedT]


def _tensors(history: TokenizedHistory, device: Device) -> dict[str, Any]:
    return {
        "history": history.history, "model": history.model,
        "tokens": torch.tensor(history.tokens, dtype=torch.int64, device=device),
        "logprobs": torch.tensor(history.logprobs, dtype=torch.float32, device=device),
        "flags": torch.tensor([int(f) for f in history.flags], dtype=torch.int32, device=device),
    }


def tensorize_history(history: TokenizedHistory, *, device: Device = None) -> TensorizedHistory:
    return TensorizedHistory(**_tensors(history, device))


def tensorize_trajectory(tokenized: TokenizedTrajectory, *,
                         device: Device = None) -> TensorizedTrajectory:
    return TensorizedTrajectory(trajectory=tokenized.trajectory, **_tensors(tokenized, device))


def tensorize_multi_history(tokenized: TokenizedMultiHistoryTrajectory, *,
                            device: Device = None) -> TensorizedMultiHistoryTrajectory:
    return TensorizedMultiHistoryTrajectory(
        trajectory=tokenized.trajectory,
        histories=[tensorize_history(h, device=device) for h in tokenized.histories])


def tensorize_group(tokenized: TokenizedTrajectoryGroup[Any], *,
                    device: Device = None) -> TensorizedTrajectoryGroup[Any]:
    return TensorizedTrajectoryGroup(
        trajectory_group=tokenized.trajectory_group,
        trajectories=[t.tensorize(device=device) for t in tokenized.trajectories])


__all__ = ["TensorizedHistory", "TensorizedMultiHistoryTrajectory", "TensorizedTrajectory",
           "TensorizedTrajectoryGroup", "tensorize_group", "tensorize_history",
           "tensorize_multi_history", "tensorize_trajectory"]
