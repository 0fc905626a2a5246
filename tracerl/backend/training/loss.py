"""The GRPO loss (pure functions, tested against TRL).

Per token: ``-min(r * A, clip(r, 1 - eps, 1 + eps_high) * A)`` with the importance ratio
``r = exp(logp - old_logp)``, plus ``beta * KL`` (the k3 estimator against the reference).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperatures: torch.Tensor
) -> torch.Tensor:
    """Log-probabilities of ``targets`` under ``softmax(logits / T)``, token by token.

    ``logits`` [B, L, V] predict ``targets`` [B, L]; ``temperatures`` [B, L]. Uses the fused
    cross-entropy kernel (one pass forward, one backward) in fp32; a single temperature is a
    scalar division, so no [B, L, V] temperature broadcast is materialised.
    """
    t = temperatures
    t0 = float(t.reshape(-1)[0]) if t.numel() else 1.0
    if t.numel() == 0 or bool((t == t0).all()):
        scaled = logits.float() if t0 == 1.0 else logits.float() / t0
    else:
        scaled = logits.float() / t.unsqueeze(-1)
    flat = scaled.reshape(-1, scaled.shape[-1])
    return -F.cross_entropy(flat, targets.reshape(-1), reduction="none").view(targets.shape)


ENTROPY_CHUNK = 512  # positions per pass: each pass holds a few [chunk, V] fp32 temporaries


def token_entropy(logits: torch.Tensor, temperatures: torch.Tensor,
                  chunk: int = ENTROPY_CHUNK) -> torch.Tensor:
    """Entropy of ``softmax(logits / T)`` per position (``logits`` [..., V], ``temperatures``
    [...]), computed ``chunk`` positions at a time: whole, its temporaries were several copies
    of the micro-batch's logits."""
    flat = logits.reshape(-1, logits.shape[-1])
    temps = temperatures.reshape(-1, 1)
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
    for start in range(0, flat.shape[0], chunk):
        logp = torch.log_softmax(flat[start:start + chunk].float() / temps[start:start + chunk],
                                 dim=-1)
        out[start:start + chunk] = -(logp.exp() * logp).sum(-1)
    return out.view(temperatures.shape)


def grpo_per_token_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, *,
    epsilon: float, epsilon_high: float | None = None, beta: float = 0.0,
    ref_logp: torch.Tensor | None = None, kl_bias_correction: bool = True,
    loss_fn: str = "ppo",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token clipped policy loss [B, L] and the pieces worth logging.

    ``advantages`` is [B] (one per sequence) or [B, L]. ``loss_fn="cispo"``:
    ``-clip(r).detach() * A * logp`` (CISPO, ART 0.5's default) instead of the PPO surrogate.
    """
    eps_high = epsilon if epsilon_high is None else epsilon_high
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    ratio = torch.exp(logp - old_logp)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + eps_high)
    if loss_fn == "cispo":
        loss = -(clipped.detach() * adv * logp)
    else:
        loss = -torch.min(ratio * adv, clipped * adv)
    parts = {
        "ratio": ratio.detach(),
        "clipped": ((ratio < 1 - epsilon) | (ratio > 1 + eps_high)).detach(),
    }
    if beta > 0:
        if ref_logp is None:
            raise ValueError("beta > 0 needs reference logprobs")
        diff = ref_logp - logp
        kl = torch.exp(diff) - diff - 1
        parts["kl"] = kl.detach()
        if kl_bias_correction:  # unbiased reverse-KL gradient off-policy (DeepSeek-V3.2)
            kl = kl * ratio
        loss = loss + beta * kl
    return loss, parts


def reduce_loss(
    per_token: torch.Tensor, mask: torch.Tensor, mode: str, normalizer: float
) -> torch.Tensor:
    """Sum a micro-batch's loss so that summing over micro-batches gives the step's mean.

    ``token``: sum over trained tokens / ``normalizer`` (all trained tokens of the step).
    ``sequence``: per-sequence token mean, summed / ``normalizer`` (sequences of the step).
    """
    mask = mask.to(per_token.dtype)
    if mode == "token":
        return (per_token * mask).sum() / normalizer
    per_seq = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return per_seq.sum() / normalizer
