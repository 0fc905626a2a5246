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


def turn_end_ids(tokenizer: Any) -> set[int]:
    """The special token the chat template closes an assistant turn with (ChatML's
    ``<|im_end|>``, Llama 3's ``<|eot_id|>``...), found by rendering one assistant turn; empty
    when the template has none or cannot render it. Generation must stop there whatever the
    model's ``eos_token_id`` says: a config naming another end token (``<|endoftext|>``) lets
    the model run past its turn's end into the next one."""
    marker = "TURN_END_PROBE_7F3A"
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "x"}, {"role": "assistant", "content": marker}],
            tokenize=False)
    except Exception:  # a template that cannot render this turn has no answer here
        return set()
    if not isinstance(text, str) or marker not in text:
        return set()
    after = tokenizer.encode(text[text.rindex(marker) + len(marker):], add_special_tokens=False)
    special = set(tokenizer.all_special_ids) | {
        i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()
        if getattr(t, "special", False)}
    return {after[0]} if after and after[0] in special else set()
