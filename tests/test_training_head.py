"""The chunked head (``training/head.py``) gives the step what the full logits gave: the same
per-token logprobs, entropy, loss and LoRA gradients, with temperatures other than 1 (one per
row and one per token) and padded rows of different lengths, on real SmolLM2."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import lora_trainer
from tracerl.backend.training.head import chunk_tokens, head_logprobs
from tracerl.backend.training.rows import NAN, Row
from tracerl.backend.training.trainer import Trainer
from tracerl.core.config import TrainConfig


@pytest.fixture(scope="module")
def trainer(smollm2_path):
    return lora_trainer(smollm2_path)


def _rows() -> list[Row]:
    """Three rows of different lengths (two padded), trained spans between prompt and tool
    segments, per-row and per-token temperatures."""
    out = []
    for i, (length, prompt) in enumerate([(90, 20), (61, 35), (40, 9)]):
        mask = [False] * prompt + [(j // 7) % 3 != 2 for j in range(length - prompt)]
        temps = [0.7] * length if i == 0 else [1.0 + 0.05 * (j % 5) for j in range(length)]
        out.append(Row(input_ids=[(97 * i + 13 * j) % 40000 + 100 for j in range(length)],
                       loss_mask=mask, old_logprobs=[-2.5 if m else NAN for m in mask],
                       temperatures=temps, advantage=(1.0, -0.5, 0.8)[i]))
    return out


def _step_parts(trainer: Trainer, fused: bool, config: TrainConfig, padding_mask: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Logprobs and entropy [B, L] of the rows' trained tokens, the step's metrics' loss and
    the LoRA gradients, by one path (and with or without the padding mask)."""
    trainer.fused_head = fused
    trainer.causal_without_padding_mask = not padding_mask
    try:
        t = trainer.tensors(_rows())
        trainer.model.zero_grad(set_to_none=True)
        with torch.no_grad():
            logp, entropy = trainer.logprobs(t, entropy=True)
        trainer.optimizer.zero_grad(set_to_none=True)
        metrics = trainer.backward([_rows()], config)
        grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()
                 if p.requires_grad and p.grad is not None}
    finally:
        trainer.fused_head, trainer.causal_without_padding_mask = True, True
    assert entropy is not None
    m = t["mask"]
    return logp[m], entropy[m], torch.tensor(metrics["loss"]), grads


def test_chunked_head_equals_the_full_logits(trainer):
    """With a KL term: the reference logprobs go through the same path."""
    config = TrainConfig(beta=0.05, epsilon=0.2, epsilon_high=0.28)
    trainer.prepare(config)
    assert trainer.output_head() is not None  # SmolLM2 takes the chunked path
    old = _step_parts(trainer, False, config)
    new = _step_parts(trainer, True, config)
    assert old[0].numel() > 80
    torch.testing.assert_close(new[0], old[0], atol=2e-5, rtol=1e-5)  # logprobs
    torch.testing.assert_close(new[1], old[1], atol=2e-5, rtol=1e-5)  # entropy
    torch.testing.assert_close(new[2], old[2], atol=1e-6, rtol=1e-5)  # loss
    assert old[3].keys() == new[3].keys() and len(old[3]) > 0
    for name, grad in old[3].items():
        torch.testing.assert_close(new[3][name], grad, atol=1e-7, rtol=2e-4, msg=name)


def test_padded_rows_need_no_padding_mask(trainer):
    """Right-padded rows in a causal model: no real token attends to a pad, so attention
    without the padding mask (plain causal, sdpa's flash path) gives the trained tokens the
    same logprobs, entropy, loss and gradients as the masked attention; the mask is what the
    model gets only where asked."""
    config = TrainConfig(beta=0.05)
    trainer.prepare(config)
    t = trainer.tensors(_rows())
    assert trainer.padding_mask(t) is None and not bool(t["attention_mask"].all())  # padded
    masked = _step_parts(trainer, True, config, padding_mask=True)
    causal = _step_parts(trainer, True, config)
    torch.testing.assert_close(causal[0], masked[0], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(causal[1], masked[1], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(causal[2], masked[2], atol=1e-6, rtol=1e-5)
    assert masked[3].keys() == causal[3].keys() and len(masked[3]) > 0
    for name, grad in masked[3].items():
        torch.testing.assert_close(causal[3][name], grad, atol=1e-7, rtol=2e-4, msg=name)


def test_head_logprobs_match_cross_entropy_across_chunks():
    """More tokens than one chunk, a bias, per-token temperatures: the values and the hidden
    states' gradient of the plain computation."""
    torch.manual_seed(0)
    vocab, hidden, n = 1000, 16, 2 * chunk_tokens(1000) + 5
    h = torch.randn(n, hidden, requires_grad=True)
    w, b = torch.randn(vocab, hidden), torch.randn(vocab)
    y, temps = torch.randint(0, vocab, (n,)), torch.rand(n) + 0.5
    weights = torch.randn(n)
    logp, ent = head_logprobs(h, w, b, y, temps, entropy=True)
    (logp * weights).sum().backward()
    got = h.grad.clone()
    h.grad = None
    z = (h @ w.T + b) / temps[:, None]
    ref = -torch.nn.functional.cross_entropy(z, y, reduction="none")
    (ref * weights).sum().backward()
    full = torch.log_softmax(z.detach(), -1)
    torch.testing.assert_close(logp, ref.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, -(full.exp() * full).sum(-1), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(got, h.grad, atol=1e-5, rtol=1e-4)


def test_train_dtype_setting_names_the_policys_dtype(monkeypatch):
    from tracerl.backend.training.trainer import training_device
    from tracerl.core.errors import ConfigError

    monkeypatch.delenv("TRACERL_TRAIN_DTYPE", raising=False)
    assert training_device("cpu") == (torch.device("cpu"), torch.float32)
    monkeypatch.setenv("TRACERL_TRAIN_DTYPE", "bfloat16")
    assert training_device("cpu")[1] is torch.bfloat16
    monkeypatch.setenv("TRACERL_TRAIN_DTYPE", "fp8")
    with pytest.raises(ConfigError, match="TRACERL_TRAIN_DTYPE"):
        training_device("cpu")
