"""What a class a plugin provides by name (an engine, a launcher) has in common."""

from __future__ import annotations

from abc import ABC
from typing import ClassVar


class Pluggable(ABC):
    """A class selected by its ``name`` among those the plugins provide."""

    name: ClassVar[str]

    @classmethod
    def available(cls) -> bool:
        """Whether this class can run here (its packages are importable)."""
        return True
