"""A model name as callers send it, ``[project/]name[@step]``: parsed and written here only.

``project/name`` names a registered model whatever else is registered; a bare ``name`` is
accepted while one project serves it; ``@step`` asks for checkpoint ``step`` (``@0``: the base
model). Parsing never fails: the text after the first ``@`` is kept as written, and
:attr:`ModelName.step` is None unless it is a plain decimal number, so the gateway can refuse
``agent@latest`` naming it (a 404), not crash on it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelName:
    """``base`` (``project/name`` or ``name``) and the text after ``@`` (None: no ``@``)."""

    base: str
    step_text: str | None = None

    @classmethod
    def parse(cls, text: str) -> ModelName:
        """Split ``text`` at its first ``@``."""
        base, at, step = text.partition("@")
        return cls(base, step if at else None)

    @classmethod
    def of(cls, base: str, step: int | None = None) -> ModelName:
        """The name of checkpoint ``step`` of ``base`` (None: the unpinned name)."""
        return cls(base, None if step is None else str(step))

    @property
    def qualified(self) -> bool:
        """Whether a project is named (``project/name``)."""
        return "/" in self.base

    @property
    def project(self) -> str | None:
        """The text before the first ``/`` of the base (None: a bare name)."""
        project, slash, _ = self.base.partition("/")
        return project if slash else None

    @property
    def name(self) -> str:
        """The base without its project."""
        return self.base.partition("/")[2] if self.qualified else self.base

    @property
    def pinned(self) -> bool:
        """Whether a step was asked for (an ``@``, well-formed or not)."""
        return self.step_text is not None

    @property
    def step(self) -> int | None:
        """The step asked for; None when none was, or when it is not a plain decimal number
        (``@-1``, ``@latest``, ``@``, ``@²``)."""
        text = self.step_text
        return int(text) if text is not None and text.isascii() and text.isdigit() else None

    @property
    def local(self) -> ModelName:
        """The name without its project (``name[@step]``)."""
        return ModelName(self.name, self.step_text)

    def __str__(self) -> str:
        return self.base if self.step_text is None else f"{self.base}@{self.step_text}"
