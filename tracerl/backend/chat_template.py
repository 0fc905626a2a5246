"""Rendering chat messages to prompt token ids with the model's own chat template."""

from __future__ import annotations

from typing import Any


def render_prompt(tokenizer: Any, messages: list[dict[str, Any]],
                  tools: list[dict[str, Any]] | None = None) -> list[int]:
    """Token ids of ``messages`` followed by the assistant generation prompt."""
    kwargs = {"tools": tools} if tools else {}
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
