"""The policy of one model on a base of its own: peft on transformers, or Unsloth's
FastLanguageModel when importable on a GPU (same loss, same rows). :class:`Trainer` loads the
base and its LoRA, then is the :class:`~.policy.Policy` of its adapter; the loading pieces
(device, tokenizer, LoRA config) serve the shared base (``adapters.py``) and the distributed
coordinator too.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import torch

from ...core import settings
from ...core.config import LoraConfig
from ..chat_template import apply_chat_template_override
from . import fused_lora
from .policy import Policy


def unsloth_usable() -> bool:
    return (not settings.TRACERL_DISABLE_UNSLOTH.get() and torch.cuda.is_available()
            and importlib.util.find_spec("unsloth") is not None)


class Trainer(Policy):
    """Holds the policy (base + LoRA) and its optimizer between steps: the base model at
    ``model_path``, loaded for this policy alone, and the adapter of ``adapter_path`` (None: a
    fresh one)."""

    def __init__(self, model_path: Path, lora: LoraConfig, adapter_path: Path | None = None,
                 device: str | None = None, chat_template: str | None = None) -> None:
        torch_device, dtype = training_device(device)
        tokenizer = load_tokenizer(model_path, chat_template)
        backend = "unsloth" if unsloth_usable() and torch_device.type == "cuda" else "peft"
        model = (load_unsloth(model_path, lora, dtype) if backend == "unsloth"
                 else load_peft(model_path, lora, torch_device, dtype))
        super().__init__(model, tokenizer, lora, device=torch_device, dtype=dtype,
                         adapter_path=adapter_path, backend=backend)
        if torch_device.type == "cpu" and type(self).distribute is Policy.distribute:
            # LoRA layers in one autograd node each (fused_lora.py): a faster CPU step (the
            # distributed ranks keep peft's layers under their wrappers)
            fused_lora.install(self.model)


# --- loading ---------------------------------------------------------------------------------

def training_device(device: str | None) -> tuple[torch.device, torch.dtype]:
    """The device a policy trains on (default: CUDA when there is one) and its weights' dtype."""
    torch_device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    named = settings.TRACERL_TRAIN_DTYPE.get()
    if named != "auto":
        return torch_device, {"float32": torch.float32, "bfloat16": torch.bfloat16}[named]
    return torch_device, torch.bfloat16 if torch_device.type == "cuda" else torch.float32


def load_tokenizer(model_path: Path, chat_template: str | None) -> Any:
    """The model's tokenizer, with the served chat template (``chat_template``) if one is set."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    apply_chat_template_override(tokenizer, chat_template)
    return tokenizer


def peft_config(lora: LoraConfig) -> Any:
    """peft's config of a LoRA adapter of shape ``lora``."""
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                          target_modules=list(lora.target_modules), task_type="CAUSAL_LM")


def load_base(model_path: Path, device: torch.device, dtype: torch.dtype) -> Any:
    """The base model on ``device``, frozen weights in ``dtype``."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    return base.to(device)  # type: ignore[arg-type]  # wraps() on .to: device as self


def load_peft(model_path: Path, lora: LoraConfig, device: torch.device, dtype: torch.dtype
              ) -> Any:
    """The base model with a fresh LoRA adapter (peft's ``default``)."""
    from peft import get_peft_model

    return get_peft_model(load_base(model_path, device, dtype), peft_config(lora))


def load_unsloth(model_path: Path, lora: LoraConfig, dtype: torch.dtype
                 ) -> Any:  # pragma: no cover - GPU only
    """Unsloth's FastLanguageModel with a fresh LoRA adapter."""
    # the loss needs logits, not Unsloth's fused cross-entropy
    os.environ.setdefault("UNSLOTH_RETURN_LOGITS", "1")
    from transformers import AutoConfig
    from unsloth import FastLanguageModel

    # the model's own context length: a longer one makes Unsloth rescale RoPE, and the
    # trained policy would no longer be the served one
    max_len = getattr(AutoConfig.from_pretrained(model_path), "max_position_embeddings", 8192)
    model, _ = FastLanguageModel.from_pretrained(
        model_name=str(model_path), dtype=dtype, load_in_4bit=False, max_seq_length=max_len
    )
    return FastLanguageModel.get_peft_model(
        model, r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules), use_gradient_checkpointing=False)
