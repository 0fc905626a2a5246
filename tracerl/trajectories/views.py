"""What ART's tokenized and tensorized views share: a pydantic base, and ``reward``/``metrics``/
``metadata`` read and written through to the source trajectory."""

from __future__ import annotations

from typing import Any

import pydantic

from ..core.trajectory import Trajectory


class Tokenized(pydantic.BaseModel):
    """NaN logprobs serialize as strings in JSON, as ART's do."""

    model_config = pydantic.ConfigDict(ser_json_inf_nan="strings")


class OfTrajectory(Tokenized):
    """ART's ``reward``/``metrics``/``metadata`` properties, read and written through to the
    source trajectory."""

    trajectory: Trajectory

    @property
    def reward(self) -> float:
        return self.trajectory.reward

    @reward.setter
    def reward(self, value: float) -> None:
        self.trajectory.reward = value

    @property
    def metrics(self) -> dict[str, float]:
        return self.trajectory.metrics

    @metrics.setter
    def metrics(self, value: dict[str, float]) -> None:
        self.trajectory.metrics = value

    @property
    def metadata(self) -> dict[str, Any]:
        return self.trajectory.metadata

    @metadata.setter
    def metadata(self, value: dict[str, Any]) -> None:
        self.trajectory.metadata = value
