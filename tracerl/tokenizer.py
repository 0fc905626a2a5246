"""ART's ``art.get_tokenizer`` (``art.tokenizer``): a base model's Hugging Face tokenizer.

``base_model`` is what ``TrainableModel(base_model=...)`` takes here: a local model folder or the
embedded ``"smollm2"``; no model hub is contacted (a hub name raises a ``ConfigError`` saying
so). transformers loads on the first call, not at import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .backend.weights import resolve_base_model
from .core.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def get_tokenizer(base_model: str, *, revision: str | None = None,
                  **kwargs: Any) -> PreTrainedTokenizerBase:
    """The tokenizer of ``base_model`` (a fresh instance each call, as in ART: changing one's
    chat template changes no other). Other keywords go to ``AutoTokenizer.from_pretrained``."""
    if revision is not None:
        raise ConfigError(f"revision={revision!r}: tracerl loads tokenizers from local model "
                          "folders, which have no revisions; check the revision out into a "
                          "folder and pass that folder as base_model")
    from transformers import AutoTokenizer

    tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
        resolve_base_model(base_model), **kwargs)
    return tokenizer


__all__ = ["get_tokenizer"]
