"""Activation checkpointing sized to a memory budget: how many decoder layers a step
recomputes in its backward pass instead of keeping their activations.

A LoRA step keeps, per token and decoder layer, the inputs of every adapted projection and
what the attention, norms and MLP need for their gradients: measured on SmolLM2-135M (fp32,
LoRA on all seven projections, saved-tensor hooks), ``4 x intermediate + 6 x hidden +
2 x key/value width`` elements, 1.15 MiB per token over its 30 layers (linear in the row's
length: the attention saves no ``[L, L]`` matrix). A checkpointed layer keeps only its input
(``hidden`` elements a token) and, in the backward pass, one layer's activations at a time
come back; the first layers are the checkpointed ones, so that they come back once the later
layers' activations are freed. :func:`plan` checkpoints the fewest layers that bring the
step's largest micro-batch within the budget (each costs one more forward of that layer), all
of them when none does; ``TrainConfig.gradient_checkpointing`` True or False overrides it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# the CPU budget when TrainConfig.activation_memory_mb is unset: a 4,096-token micro-batch of
# SmolLM2-135M stays within 2 GB (issue 40) and a 1,024-token one (1.2 GB) runs unchanged
CPU_BUDGET_MB = 1536.0
# the CUDA budget when unset: this share of the memory the device has free as the step starts
CUDA_BUDGET_SHARE = 0.5
MB = 2**20


@dataclass(frozen=True)
class Plan:
    """The checkpointed layers of a step and the estimates that chose them."""

    layers: int  # decoder layers checkpointed (the first ones), 0..total
    total: int  # decoder layers of the model
    estimate_mb: float  # activations of the largest micro-batch without checkpointing
    planned_mb: float  # ... with ``layers`` checkpointed
    budget_mb: float

    def as_metrics(self) -> dict[str, float]:
        """The decision, in the step's metrics."""
        return {"checkpointed_layers": float(self.layers),
                "activation_estimate_mb": round(self.estimate_mb, 1),
                "activation_planned_mb": round(self.planned_mb, 1),
                "activation_budget_mb": round(self.budget_mb, 1)}


def text_config(config: Any) -> Any:
    """The language model's part of a transformers ``config`` (itself for a text-only model)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def layer_bytes_per_token(config: Any, element_bytes: int) -> tuple[float, float]:
    """Bytes one token keeps in one decoder layer of a model of ``config`` (a transformers
    config): without checkpointing, and checkpointed (the layer's input)."""
    text = text_config(config)
    hidden = int(text.hidden_size)
    intermediate = int(getattr(text, "intermediate_size", None) or 4 * hidden)
    heads = int(getattr(text, "num_attention_heads", 1) or 1)
    head_dim = int(getattr(text, "head_dim", None) or hidden // heads)
    kv = int(getattr(text, "num_key_value_heads", None) or heads) * head_dim
    return (4 * intermediate + 6 * hidden + 2 * kv) * element_bytes, hidden * element_bytes


def plan(config: Any, tokens: int, element_bytes: int, budget_mb: float,
         head_mb: float = 0.0, forced: bool | None = None) -> Plan:
    """Checkpointed layers for a micro-batch of ``tokens`` padded tokens of a model of
    ``config`` whose activations are ``element_bytes`` wide, within ``budget_mb`` (of which the
    output head takes ``head_mb``, whatever is checkpointed); ``forced``: True all layers,
    False none."""
    text = text_config(config)
    total = int(text.num_hidden_layers)
    full, kept = layer_bytes_per_token(config, element_bytes)
    full_mb, kept_mb = full * tokens / MB, kept * tokens / MB

    def planned(k: int) -> float:
        # the first k checkpointed: the forward ends holding the others' activations and k
        # inputs; the backward frees the others' before it recomputes the first k, one by one
        return head_mb + k * kept_mb + max(total - k, 1 if k else 0) * full_mb

    if forced is not None:
        k = total if forced else 0
    else:  # the fewest k with planned(k) <= budget: each layer saves full - kept (all: total)
        over = planned(0) - budget_mb
        k = 0 if over <= 0 else min(total, math.ceil(over / max(full_mb - kept_mb, 1e-9)))
    return Plan(k, total, planned(0), planned(k), budget_mb)


def default_budget_mb(device: Any) -> float:
    """The budget when none is set: :data:`CPU_BUDGET_MB` on CPU; on CUDA a share of the
    memory free on the device now (the engine asleep)."""
    if getattr(device, "type", "cpu") == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info(device)
        return CUDA_BUDGET_SHARE * free / MB
    return CPU_BUDGET_MB


def apply(model: Any, layers: int,
          context_fn: Callable[[], tuple[Any, Any]] | None = None) -> None:
    """Checkpoint the first ``layers`` decoder layers of ``model`` (a transformers model, or
    peft's around one) and no others; 0 turns checkpointing off. ``context_fn``: torch
    checkpoint's, called as a checkpointed layer's forward starts, the contexts of that forward
    and of its recompute in the backward pass (the state the forward ran under, which the
    recompute must see again: torch counts the tensors each saves)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    if layers == 0:
        if getattr(model, "is_gradient_checkpointing", False):
            model.gradient_checkpointing_disable()
        return
    # non-reentrant: the embeddings' output need not require a gradient (LoRA freezes them)
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if context_fn is not None:
        kwargs["context_fn"] = context_fn
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    blocks = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    for i, block in enumerate(blocks):
        block.gradient_checkpointing = i < layers
