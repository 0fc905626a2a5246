"""``ModelSpec``: what a backend needs to know of a model, the same on every side.

The user's :class:`~tracerl.rollout.model.Model` hands its spec to the backend; the local backend
writes it as ``model.json``; the remote client sends it to ``tracerl serve``, which validates it
with this class before anything is written. Hooks receive it as their ``model`` argument.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .config import ModelConfig
from .errors import ConfigError
from .storage import validate_name


class ModelSpec(BaseModel):
    """A model's identity (``project``/``name``), its base weights and how it is served."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="the model's name within its project (a folder name: its "
                      "checkpoints, trajectories and served name)")
    project: str = Field(description="the project the model belongs to (a folder holding its "
                         "models side by side)")
    base_model: str | None = Field(None, description="the weights it starts from: a model "
                                   "folder (with config.json) or 'smollm2', the embedded default; "
                                   "None for a model served elsewhere")
    trainable: bool = Field(True, description="whether the backend trains a LoRA adapter for "
                            "it (False: served as it is)")
    config: ModelConfig = Field(default_factory=ModelConfig,
                                description="its LoRA and serving settings (ModelConfig)")

    @field_validator("name")
    @classmethod
    def _valid_name(cls, value: str) -> str:
        return validate_name("model", value)

    @field_validator("project")
    @classmethod
    def _valid_project(cls, value: str) -> str:
        return validate_name("project", value)

    @property
    def key(self) -> str:
        """``project/name``: a model's identity wherever models are kept side by side."""
        return f"{self.project}/{self.name}"

    def definition(self) -> dict[str, Any]:
        """The JSON object written to ``model.json`` and sent to a remote server."""
        return self.model_dump(mode="json")

    @classmethod
    def from_definition(cls, definition: Any) -> ModelSpec:
        """Validate a definition (a client's or ``model.json``); errors name the field."""
        if not isinstance(definition, dict):
            raise ConfigError("a model definition must be a JSON object")
        unknown = sorted(set(definition) - set(cls.model_fields))
        if unknown:
            raise ConfigError(f"unknown model definition fields: {unknown}")
        try:
            return cls.model_validate(definition)
        except ValidationError as e:
            problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}"
                                 for err in e.errors())
            raise ConfigError(f"invalid model definition: {problems}") from None

    @classmethod
    def read(cls, path: Path) -> ModelSpec:
        """The definition in the file ``path`` (a ``model.json``); a :class:`ConfigError`
        naming the file when it is not JSON, not UTF-8 or not a valid definition."""
        try:
            return cls.from_definition(json.loads(path.read_text()))
        except (ValueError, TypeError) as e:  # JSON, UTF-8, ConfigError (a ValueError)
            raise ConfigError(f"{path} is not a readable model definition: "
                              f"{type(e).__name__}: {str(e)[:300]}") from None


class HasModelSpec(Protocol):
    """What user code passes where a spec is wanted: a ``Model`` (``backend.train(model, ...)``,
    ``backend.pending_groups(model)``)."""

    @property
    def spec(self) -> ModelSpec: ...


ModelLike = ModelSpec | HasModelSpec


def spec_of(model: ModelLike) -> ModelSpec:
    """The spec of a user's model handle, or the spec itself."""
    return model if isinstance(model, ModelSpec) else model.spec
