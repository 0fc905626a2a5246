"""Base model whose validation errors name the field as :class:`InvalidTrajectoryError`."""

from __future__ import annotations

import json
from typing import Any, Self

from pydantic import BaseModel, ValidationError

from .errors import InvalidTrajectoryError


class Validated(BaseModel):
    """Raises :class:`InvalidTrajectoryError` (naming the field) instead of pydantic's error."""

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise InvalidTrajectoryError(f"invalid {type(self).__name__}: {e}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        try:
            super().__setattr__(name, value)
        except ValidationError as e:
            raise InvalidTrajectoryError(f"invalid {type(self).__name__}.{name}: {e}") from None

    @classmethod
    def from_json(cls, text: str | bytes) -> Self:
        try:
            return cls.model_validate_json(text)
        except ValidationError as e:
            raise InvalidTrajectoryError(f"invalid {cls.__name__} JSON: {e}") from None

    def to_json(self) -> str:
        return self.model_dump_json()


def check_int(name: str, value: object, minimum: int) -> int:
    """``value`` if it is an integer (not a bool) >= ``minimum``, else a ValueError naming
    ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def check_json(name: str, value: dict[str, Any]) -> dict[str, Any]:
    """``value`` unchanged if it serialises to strict JSON, else an error naming ``name``."""
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise InvalidTrajectoryError(f"{name} must be JSON-serialisable: {e}") from None
    return value
