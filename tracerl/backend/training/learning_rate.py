"""The learning rate ``TrainConfig(learning_rate="auto")`` stands for, from the model's width.

Anchored where it was measured: 1e-3 trains SmolLM2-135M (hidden size 576) with the default
LoRA (rank 8, alpha 16) on every catalog task (BENCHMARKS.md: ``tool-products`` 0.00 ->
0.97-1.00 held-out in 5 of 5 seeds on an H100; on a LangChain tool agent, 10 steps at 3e-4
moved held-out success 0.11 -> 0.23 where 1e-3 reached 0.75). Other widths follow the fit of
LoRA's best learning rate to the hidden size by Thinking Machines ("LoRA Without Regret", 2025;
the Tinker cookbook's ``hyperparam_utils.get_lr``): proportional to ``(1 / hidden_size) ** p``,
``p`` 0.0775 for Qwen models and 0.781 for Llama's and the rest (the smaller rate for a wider
model where the family is not known). At a fixed alpha that rate does not depend on the rank
(the update is scaled by alpha / r); it is inversely proportional to alpha.
"""

from __future__ import annotations

from typing import Any

from ...core.config import LoraConfig
from .checkpointing import text_config

ANCHOR_RATE = 1e-3  # measured: SmolLM2-135M, LoRA alpha 16
ANCHOR_HIDDEN = 576
ANCHOR_ALPHA = 16
QWEN_EXPONENT = 0.0775
OTHER_EXPONENT = 0.781


def auto_learning_rate(model_config: Any, lora: LoraConfig) -> float:
    """The learning rate ``"auto"`` resolves to for a model of ``model_config`` (a transformers
    config) trained with ``lora``."""
    text = text_config(model_config)
    hidden = int(text.hidden_size)
    family = str(getattr(text, "model_type", "") or "")
    exponent = QWEN_EXPONENT if family.startswith("qwen") else OTHER_EXPONENT
    return ANCHOR_RATE * (ANCHOR_ALPHA / lora.alpha) * (ANCHOR_HIDDEN / hidden) ** exponent
