"""The fused LoRA layers (``training/fused_lora.py``) give the step what peft's layers gave: the
same logprobs, loss, metrics and LoRA gradients (padded rows of different lengths, a KL term
whose reference pass runs with the adapter disabled), on real SmolLM2; and peft's own forward
runs wherever the fused one does not apply."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import lora_trainer
from tracerl.backend.training import fused_lora
from tracerl.backend.training.rows import NAN, Row
from tracerl.backend.training.trainer import Trainer
from tracerl.core.config import TrainConfig


@pytest.fixture(scope="module")
def trainer(smollm2_path):
    return lora_trainer(smollm2_path)


def _rows() -> list[Row]:
    out = []
    for i, (length, prompt) in enumerate([(80, 20), (57, 30), (33, 9)]):
        mask = [False] * prompt + [(j // 7) % 3 != 2 for j in range(length - prompt)]
        out.append(Row(input_ids=[(89 * i + 17 * j) % 40000 + 100 for j in range(length)],
                       loss_mask=mask, old_logprobs=[-2.5 if m else NAN for m in mask],
                       temperatures=[0.9] * length, advantage=(1.0, -0.5, 0.8)[i]))
    return out


def _step(trainer: Trainer, config: TrainConfig
          ) -> tuple[torch.Tensor, dict[str, float], dict[str, torch.Tensor]]:
    t = trainer.tensors(_rows())
    with torch.no_grad():
        logp = trainer.logprobs(t)[0][t["mask"]]
    trainer.optimizer.zero_grad(set_to_none=True)
    metrics = trainer.backward([_rows()], config)
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()
             if p.requires_grad and p.grad is not None}
    return logp, metrics, grads


def test_the_cpu_trainer_runs_the_fused_layers(trainer):
    kinds = {type(m).__name__ for m in trainer.model.modules() if hasattr(m, "lora_A")}
    assert kinds == {"FusedLoraLinear"}


@pytest.mark.parametrize("beta", [0.0, 0.04], ids=["no-kl", "kl"])
def test_fused_layers_give_peft_s_logprobs_loss_and_gradients(trainer, beta):
    config = TrainConfig(beta=beta)
    fused = _step(trainer, config)
    assert fused_lora.uninstall(trainer.model) == 30 * 7
    try:
        peft = _step(trainer, config)
    finally:
        assert fused_lora.install(trainer.model) == 30 * 7
    torch.testing.assert_close(fused[0], peft[0], rtol=1e-5, atol=1e-5)
    for key in ("loss", "ratio", "kl", "entropy"):
        assert fused[1][key] == pytest.approx(peft[1][key], rel=1e-5, abs=1e-7), key
    assert fused[2].keys() == peft[2].keys() and len(fused[2]) == 2 * 30 * 7
    for name, grad in peft[2].items():
        torch.testing.assert_close(fused[2][name], grad, rtol=1e-4, atol=1e-6, msg=name)
    assert any(g.abs().sum() > 0 for n, g in fused[2].items() if "lora_A" in n)


def test_peft_s_forward_runs_where_the_fused_one_does_not_apply(trainer):
    layer = next(m for m in trainer.model.modules() if type(m).__name__ == "FusedLoraLinear")
    x = torch.randn(2, 5, layer.in_features)
    assert fused_lora._fused_forward(layer, x) is not None
    with trainer.model.disable_adapter():  # the reference pass: the base alone
        assert fused_lora._fused_forward(layer, x) is None
        torch.testing.assert_close(layer(x), layer.base_layer(x))
    assert fused_lora._fused_forward(layer, x.double()) is None
