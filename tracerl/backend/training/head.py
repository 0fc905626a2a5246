"""The output head's token log-probabilities without the ``[tokens, vocab]`` logits.

A step needs, per trained token, ``log softmax(h W^T / T)[y]`` (with its gradient) and the
entropy of that distribution (a metric). Materialised, the logits of a micro-batch and their
softmax and gradient are several ``[tokens, vocab]`` fp32 tensors: with SmolLM2's 49,152-token
vocabulary, 0.8 GB per 4,096 tokens each. :func:`head_logprobs` projects ``chunk`` tokens at
a time and keeps only what backward needs: the approach of Liger-Kernel's fused linear
cross-entropy (``liger_kernel/ops/fused_linear_cross_entropy.py``), in plain torch so it runs on
CPU and GPU alike.

The gradient is taken in the forward pass. ``logp_i`` depends on ``h_i`` alone, so its
Jacobian is one vector per token, ``d_i = (W[y_i] - p_i W) / T_i`` (``p_i`` the softmax): it
is computed chunk by chunk with the logits, kept (``[tokens, hidden]``, the size of the hidden
states), and backward scales it by each token's incoming gradient. The head's weight gets no
gradient (LoRA leaves it frozen; a trained head takes the materialised path, ``policy.py``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

# elements of one chunk's [tokens, vocab] fp32 temporaries (64 MiB each): SmolLM2's vocabulary
# gives chunks of 341 tokens, Qwen2.5's (151,936) chunks of 110 (at least MIN_CHUNK)
CHUNK_ELEMENTS = 1 << 24
MIN_CHUNK = 64


def chunk_tokens(vocab: int) -> int:
    """Tokens projected at once for a head of ``vocab`` outputs."""
    return max(MIN_CHUNK, CHUNK_ELEMENTS // max(vocab, 1))


class _HeadLogprobs(torch.autograd.Function):
    """``(logp [N], entropy [N] or empty)`` of ``hidden [N, H]`` under ``weight [V, H]``."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                targets: torch.Tensor, temps: torch.Tensor, want_entropy: bool
                ) -> tuple[torch.Tensor, torch.Tensor]:
        n, chunk = hidden.shape[0], chunk_tokens(weight.shape[0])
        need_grad = ctx.needs_input_grad[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(n if want_entropy else 0, dtype=torch.float32,
                              device=hidden.device)
        jacobian = torch.empty_like(hidden) if need_grad else None
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            y, t = targets[s:e, None], temps[s:e, None]
            z = F.linear(hidden[s:e].to(weight.dtype), weight, bias).float().div_(t)
            z.sub_(torch.logsumexp(z, dim=-1, keepdim=True))  # log p, in place
            logp[s:e] = z.gather(1, y).squeeze(1)
            p = z.exp_() if not want_entropy else z.exp()
            if want_entropy:
                entropy[s:e] = -(p * z).sum(-1)
            if jacobian is not None:  # d logp / d z = (onehot(y) - p) / T; times W: d / d h
                p.neg_().scatter_add_(1, y, torch.ones_like(y, dtype=p.dtype)).div_(t)
                jacobian[s:e] = (p.to(weight.dtype) @ weight).to(hidden.dtype)
            del z, p
        ctx.save_for_backward(jacobian)
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx: Any, grad_logp: torch.Tensor, grad_entropy: torch.Tensor
                 ) -> tuple[torch.Tensor | None, None, None, None, None, None]:
        (jacobian,) = ctx.saved_tensors
        grad = jacobian * grad_logp[:, None].to(jacobian.dtype)
        return grad, None, None, None, None, None


def head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  targets: torch.Tensor, temperatures: torch.Tensor, entropy: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities of ``targets`` [N] under ``softmax((hidden W^T + bias) / T)``
    (``hidden`` [N, H], ``weight`` [V, H], ``temperatures`` [N]), with their gradient with
    respect to ``hidden``; and, with ``entropy``, each distribution's entropy (no gradient).
    Never holds more than one chunk's ``[tokens, V]`` logits."""
    if weight.requires_grad:
        raise ValueError("head_logprobs gives no gradient to the head's weight")
    logp, ent = _HeadLogprobs.apply(hidden, weight, bias, targets,
                                    temperatures.to(torch.float32), entropy)
    return logp, ent if entropy else None
