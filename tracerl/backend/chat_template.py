"""Rendering chat messages to prompt token ids with the model's own chat template."""

from __future__ import annotations

from pathlib import Path
from typing import Any

TEMPLATES_DIR = Path(__file__).parent / "templates"


def builtin_templates() -> dict[str, Path]:
    """The chat templates shipped with tracerl, by name (``chatml-tools``...)."""
    return {p.stem: p for p in TEMPLATES_DIR.glob("*.jinja")}


def chat_template_path(name_or_path: str) -> Path:
    """The Jinja file of a built-in template name or of a path given by the user."""
    builtin = builtin_templates()
    if name_or_path in builtin:
        return builtin[name_or_path]
    path = Path(name_or_path).expanduser()
    if not path.is_file():
        raise ValueError(f"chat_template {name_or_path!r} is neither a built-in template "
                         f"({', '.join(sorted(builtin))}) nor a file")
    return path.resolve()  # absolute: handed to a vLLM server


def apply_chat_template_override(tokenizer: Any, name_or_path: str | None) -> None:
    """Make ``tokenizer`` render with the configured template (no-op for None)."""
    if name_or_path:
        tokenizer.chat_template = chat_template_path(name_or_path).read_text()


def render_prompt(tokenizer: Any, messages: list[dict[str, Any]],
                  tools: list[dict[str, Any]] | None = None, *,
                  add_generation_prompt: bool = True) -> list[int]:
    """Token ids of ``messages`` followed by the assistant generation prompt (without it:
    the conversation as it is, e.g. ending in the assistant's closed turn)."""
    kwargs = {"tools": tools} if tools else {}
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, **kwargs
    )
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
