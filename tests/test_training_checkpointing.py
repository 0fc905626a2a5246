"""Activation checkpointing sized to a budget (``training/checkpointing.py``): the estimate is
what a forward of real SmolLM2 keeps, the plan checkpoints the fewest layers that fit, the
step's metrics say how many, and gradients are the same whatever is checkpointed."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import lora_trainer
from tracerl.backend.training import checkpointing
from tracerl.backend.training.adapters import SharedBase
from tracerl.backend.training.rows import NAN, Row
from tracerl.backend.training.trainer import Trainer
from tracerl.backend.training.update import accumulate_gradients
from tracerl.core.config import LoraConfig, TrainConfig
from tracerl.core.errors import ConfigError


@pytest.fixture(scope="module")
def trainer(smollm2_path):
    return lora_trainer(smollm2_path)


def _rows() -> list[Row]:
    """Two rows of different lengths (one padded), trained spans after a prompt."""
    out = []
    for i, (length, prompt) in enumerate([(70, 15), (48, 20)]):
        mask = [False] * prompt + [(j // 6) % 3 != 2 for j in range(length - prompt)]
        out.append(Row(input_ids=[(89 * i + 17 * j) % 40000 + 100 for j in range(length)],
                       loss_mask=mask, old_logprobs=[-2.0 if m else NAN for m in mask],
                       temperatures=[0.9] * length, advantage=(1.0, -0.7)[i]))
    return out


def _grads(trainer: Trainer, config: TrainConfig, largest: int
           ) -> tuple[dict[str, float], dict[str, torch.Tensor], int]:
    """The decision's metrics, the LoRA gradients of one backward over the rows, and how many
    times the first decoder layer ran (twice where it is checkpointed: the recompute)."""
    calls = [0]
    layer = trainer.model.get_base_model().model.layers[0]
    hook = layer.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    try:
        metrics = trainer.prepare(config, largest)
        trainer.optimizer.zero_grad(set_to_none=True)
        trainer.backward([_rows()], config)
    finally:
        hook.remove()
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()
             if p.requires_grad and p.grad is not None}
    return metrics, grads, calls[0]


def test_plan_checkpoints_the_fewest_layers_within_the_budget(trainer):
    config = trainer.model.get_base_model().config
    assert checkpointing.plan(config, 1024, 4, 1536.0).layers == 0  # 1.2 GB: fits
    big = checkpointing.plan(config, 4096, 4, 1536.0)
    assert 0 < big.layers < big.total == 30
    assert big.planned_mb <= 1536.0 < big.estimate_mb
    one_fewer = checkpointing.plan(config, 4096, 4, big.planned_mb + 1e-6)
    assert one_fewer.layers == big.layers  # the budget it reached is enough for as many
    assert checkpointing.plan(config, 4096, 4, big.planned_mb - 1.0).layers == big.layers + 1
    assert checkpointing.plan(config, 65536, 4, 1536.0).layers == 30  # none fits: all
    assert checkpointing.plan(config, 16, 4, 1536.0, forced=True).layers == 30
    assert checkpointing.plan(config, 65536, 4, 1536.0, forced=False).layers == 0


def test_estimate_is_what_a_forward_keeps(trainer):
    """The saved tensors of a forward without checkpointing (the parameters left out) are the
    estimate within 10%."""
    trainer.prepare(TrainConfig(gradient_checkpointing=False))
    rows = [Row(input_ids=[(31 * j) % 40000 + 100 for j in range(256)],
                loss_mask=[False] * 16 + [True] * 240, old_logprobs=[NAN] * 16 + [-2.0] * 240,
                temperatures=[1.0] * 256, advantage=1.0)]
    t = trainer.tensors(rows)
    seen = {p.untyped_storage().data_ptr() for p in trainer.model.parameters()}
    saved = [0]

    def pack(x: torch.Tensor) -> torch.Tensor:
        storage = x.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            saved[0] += storage.nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        logp, _ = trainer.logprobs(t)
    del logp
    plan = checkpointing.plan(trainer.model.get_base_model().config, 256, 4, 1e9)
    assert saved[0] / checkpointing.MB == pytest.approx(plan.estimate_mb, rel=0.1)


def test_gradients_are_the_same_whatever_is_checkpointed(trainer):
    """Off, every layer, and 'auto' under a budget that checkpoints some layers: the same LoRA
    gradients; the metrics say how many layers, and a checkpointed layer runs twice."""
    off_metrics, off, off_calls = _grads(trainer, TrainConfig(gradient_checkpointing=False), 140)
    assert off_metrics["checkpointed_layers"] == 0 and off_calls == 1
    on_metrics, on, on_calls = _grads(trainer, TrainConfig(gradient_checkpointing=True), 140)
    assert on_metrics["checkpointed_layers"] == 30 and on_calls == 2
    budget = trainer.checkpoint_plan(  # between all layers' and none's: some layers
        TrainConfig(gradient_checkpointing=True), 140).planned_mb * 1.5
    auto = TrainConfig(activation_memory_mb=budget, gradient_checkpointing="auto")
    auto_metrics, partial, partial_calls = _grads(trainer, auto, 140)
    assert 0 < auto_metrics["checkpointed_layers"] < 30 and partial_calls == 2
    assert auto_metrics["activation_planned_mb"] <= budget < auto_metrics["activation_estimate_mb"]
    assert off.keys() == on.keys() == partial.keys() and len(off) > 0
    for name, grad in off.items():
        torch.testing.assert_close(on[name], grad, atol=1e-7, rtol=1e-5, msg=name)
        torch.testing.assert_close(partial[name], grad, atol=1e-7, rtol=1e-5, msg=name)


def test_adapters_on_one_base_recompute_each_row_through_its_adapter(smollm2_path):
    """The backend's CPU policies are adapters on a shared base, each row routed to its own
    adapter in the forward: a checkpointed layer's recompute in the backward routes them the
    same (it ran peft's unrouted LoRA forward: torch's CheckpointError, 79 tensors saved in the
    forward, 58 in the recompute), and each adapter's gradients are those without
    checkpointing; with the KL term's reference pass (adapters disabled) in between."""
    torch.manual_seed(0)
    shared = SharedBase(smollm2_path, LoraConfig(r=4, alpha=8), device="cpu")
    a, b = shared.attach(None), shared.attach(None)
    with torch.no_grad():  # B non-zero: each adapter changes its rows' logits
        for name, p in shared.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    rows = _rows()
    rows[0].adapter, rows[1].adapter = a.adapter_name, b.adapter_name  # one micro-batch, mixed
    layer = shared.model.get_base_model().model.layers[0]
    grads, calls = {}, [0]
    hook = layer.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    try:
        for mode in (False, True):
            config = TrainConfig(gradient_checkpointing=mode, beta=0.1)
            calls[0] = 0
            assert a.prepare(config, 140)["checkpointed_layers"] == (30 if mode else 0)
            shared.model.zero_grad(set_to_none=True)
            accumulate_gradients(a, [rows], config, {a.adapter_name: 1.0, b.adapter_name: 1.0})
            assert calls[0] == (3 if mode else 2)  # forward, reference pass, and the recompute
            grads[mode] = {n: p.grad.clone() for n, p in shared.model.named_parameters()
                           if p.grad is not None}
    finally:
        hook.remove()
        a.prepare(TrainConfig(gradient_checkpointing=False))
    # the reference passes left the other adapter trainable (peft's disable_adapter froze it)
    assert all(p.requires_grad for p in b.trainable_parameters())
    assert grads[True].keys() == grads[False].keys()
    for policy in (a, b):  # both adapters trained (each by its own row)
        assert any(f".{policy.adapter_name}." in n for n in grads[False])
    for name, grad in grads[False].items():
        torch.testing.assert_close(grads[True][name], grad, atol=1e-7, rtol=1e-5, msg=name)


def test_the_step_metrics_carry_the_decision(trainer):
    """A step of the default config ('auto') on CPU: small micro-batches fit the default
    budget."""
    assert TrainConfig().gradient_checkpointing == "auto"
    metrics = trainer.optimize(_rows(), TrainConfig(learning_rate=1e-9))
    assert metrics["checkpointed_layers"] == 0
    assert metrics["activation_budget_mb"] == checkpointing.CPU_BUDGET_MB
    assert 0 < metrics["activation_estimate_mb"] < checkpointing.CPU_BUDGET_MB
    assert not trainer.model.is_gradient_checkpointing


def test_a_bad_budget_is_refused_naming_the_field():
    with pytest.raises((ConfigError, ValueError), match="activation_memory_mb"):
        TrainConfig(activation_memory_mb=0)
    with pytest.raises((ConfigError, ValueError), match="gradient_checkpointing"):
        TrainConfig(gradient_checkpointing="sometimes")
