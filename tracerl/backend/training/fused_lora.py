"""A LoRA linear layer's training pass in one autograd node (CPU): ``x W^T + s (x A^T) B^T``.

peft's ``lora.Linear`` computes ``base(x) + lora_B(lora_A(x)) * s``: the rank-r branch costs
~4% of the layer's FLOPs, but its ``[tokens, out]`` product, its scaling and the sum are three
more passes over the output (and as many in backward), memory-bound on a CPU: measured +32-38%
over the frozen layer alone (``benchmarks/train_step_mfu.py``, variant ``peft-lora``). Here the
branch is accumulated into the base GEMM's output (``addmm_`` with ``alpha=s``), and backward
does the same for the input gradient: the math of peft's layer, one pass fewer each way.

:func:`install` swaps the class of a model's peft ``Linear`` layers to ``FusedLoraLinear``
(a subclass, so ``isinstance`` checks and saving are unchanged); its forward takes peft's path
whenever the fused one does not apply (adapters disabled or merged, several active adapters,
per-row routing, dropout, DoRA or another variant, a trained base weight, autocast).
"""

from __future__ import annotations

from typing import Any

import torch


class _LoraLinear(torch.autograd.Function):
    """``x W^T (+ bias) + s (x A^T) B^T`` with the gradients of ``x``, ``A`` and ``B``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        h = flat @ a.t()  # [tokens, r]
        y = flat @ weight.t() if bias is None else torch.addmm(bias, flat, weight.t())
        y.addmm_(h, b.t(), alpha=scaling)
        ctx.save_for_backward(flat, h, weight, a, b)
        ctx.scaling, ctx.shape = scaling, x.shape
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        flat, h, weight, a, b = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        gh = (g @ b).mul_(ctx.scaling)  # d loss / d h: [tokens, r]
        gx = None
        if ctx.needs_input_grad[0]:
            gx = (g @ weight).addmm_(gh, a).view(ctx.shape)
        ga = gh.t() @ flat if ctx.needs_input_grad[3] else None
        gb = (g.t() @ h).mul_(ctx.scaling) if ctx.needs_input_grad[4] else None
        return gx, None, None, ga, gb, None


def _fused_forward(layer: Any, x: torch.Tensor) -> torch.Tensor | None:
    """The fused pass of ``layer`` (a peft ``lora.Linear``) on ``x``, or None where peft's
    own forward must run."""
    if layer.disable_adapters or layer.merged or len(layer.active_adapters) != 1:
        return None
    name = layer.active_adapters[0]
    if name not in layer.lora_A or name in getattr(layer, "lora_variant", {}):
        return None
    base, a, b = layer.base_layer, layer.lora_A[name], layer.lora_B[name]
    if (type(base) is not torch.nn.Linear or base.weight.requires_grad
            or (base.bias is not None and base.bias.requires_grad) or b.bias is not None
            or not isinstance(layer.lora_dropout[name], torch.nn.Identity)
            or not (x.dtype == base.weight.dtype == a.weight.dtype == b.weight.dtype)
            or torch.is_autocast_enabled(x.device.type)):
        return None
    out: torch.Tensor = _LoraLinear.apply(x, base.weight, base.bias, a.weight, b.weight,
                                          float(layer.scaling[name]))
    return out


_FUSED: dict[type, type] = {}


def _fused_class(cls: type) -> type:
    """The ``FusedLoraLinear`` subclass of peft's ``cls``."""
    if cls not in _FUSED:
        peft_forward = cls.forward  # type: ignore[attr-defined]

        def forward(self: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            out = None if args or kwargs else _fused_forward(self, x)
            if out is None:
                out = peft_forward(self, x, *args, **kwargs)
            return out

        _FUSED[cls] = type("FusedLoraLinear", (cls,), {"forward": forward, "__module__": __name__})
    return _FUSED[cls]


def install(model: Any) -> int:
    """Swap ``model``'s peft ``lora.Linear`` layers to the fused training pass; returns how
    many."""
    from peft.tuners.lora import Linear

    count = 0
    for module in model.modules():
        if type(module) is Linear:
            module.__class__ = _fused_class(Linear)
            count += 1
    return count


def uninstall(model: Any) -> int:
    """Back to peft's own ``lora.Linear`` forward; returns how many layers."""
    count = 0
    for module in model.modules():
        for cls, fused in _FUSED.items():
            if type(module) is fused:
                module.__class__ = cls
                count += 1
    return count

