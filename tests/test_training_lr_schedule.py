"""The learning-rate warmup and schedule (``TrainConfig.lr_scheduler_type``, ``warmup_steps``,
``max_steps``): the rate each real optimizer step of SmolLM2's adapter trains at, step by step,
across a checkpoint and a resume (the step count is in the checkpoint), for every schedule.
One base is loaded; each run is a fresh policy on it, and its resume a policy loaded from the
run's checkpoint (adapter, Adam state, step count), as a backend loads one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tracerl.backend.training.policy import Policy
from tracerl.backend.training.rows import Row
from tracerl.backend.training.trainer import Trainer
from tracerl.core.config import LoraConfig, TrainConfig

LORA = LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"])
NAN = float("nan")

# schedule -> (config, the rate of steps 0..3); steps 0-1 before a checkpoint, 2-3 after it
SCHEDULES = {
    "constant-warmup": (TrainConfig(learning_rate=1e-3, warmup_steps=2),
                        [1e-3 / 3, 2e-3 / 3, 1e-3, 1e-3]),
    "linear": (TrainConfig(learning_rate=1e-3, lr_scheduler_type="linear", warmup_steps=1,
                           max_steps=3),
               [5e-4, 1e-3, 5e-4, 0.0]),
    "cosine": (TrainConfig(learning_rate=1e-3, lr_scheduler_type="cosine", max_steps=3),
               [1e-3, 7.5e-4, 2.5e-4, 0.0]),
}


def rows(step: int) -> list[Row]:
    """Two short rows with engine logprobs and advantages of both signs (a real gradient)."""
    g = torch.Generator().manual_seed(step)
    out = []
    for i in range(2):
        ids = torch.randint(10, 1000, (12,), generator=g).tolist()
        out.append(Row(ids, [False] * 8 + [True] * 4, [NAN] * 8 + [-1.5] * 4, [1.0] * 12,
                       advantage=(-1.0) ** i))
    return out


@pytest.fixture(scope="module")
def base(smollm2_path) -> Trainer:
    return Trainer(smollm2_path, LORA, device="cpu")


def policy(base: Trainer, checkpoint: Path | None = None) -> Policy:
    """A policy of ``base``'s model: fresh (step 0), or from ``checkpoint``."""
    return Policy(base.model, base.tokenizer, LORA, device=base.device, dtype=base.dtype,
                  adapter_path=checkpoint)


@pytest.mark.parametrize("config, expected", SCHEDULES.values(), ids=list(SCHEDULES))
def test_each_step_trains_at_its_scheduled_rate_across_a_resume(base, tmp_path, config,
                                                                expected):
    trainer, rates = policy(base), []
    for step in range(2):
        rates.append(trainer.optimize(rows(step), config)["learning_rate"])
        assert trainer.optimizer.param_groups[0]["lr"] == rates[-1]
    trainer.save(tmp_path)
    assert json.loads((tmp_path / "trainer_state.json").read_text())["steps_done"] == 2
    resumed = policy(base, tmp_path)
    assert resumed.steps_done == 2
    for step in range(2, 4):
        rates.append(resumed.optimize(rows(step), config)["learning_rate"])
        assert resumed.optimizer.param_groups[0]["lr"] == rates[-1]
    assert rates == pytest.approx(expected, abs=1e-10)
    assert rates == [config.learning_rate_at(s) for s in range(4)]


def test_a_decaying_schedule_needs_its_length():
    with pytest.raises(ValueError, match="set max_steps"):
        TrainConfig(lr_scheduler_type="cosine")
    with pytest.raises(ValueError, match=r"warmup_steps \(4\) must be fewer than max_steps"):
        TrainConfig(lr_scheduler_type="linear", warmup_steps=4, max_steps=4)


def test_the_schedule_crosses_the_wire_of_the_remote_and_distributed_trainers():
    """The remote client sends ``model_dump(mode="json")``, the distributed coordinator
    ``model_dump()``: both rebuild the same schedule."""
    config = SCHEDULES["linear"][0]
    for dumped in (config.model_dump(mode="json"), config.model_dump()):
        again = TrainConfig.model_validate(json.loads(json.dumps(dumped)))
        assert [again.learning_rate_at(s) for s in range(7)] == \
            [config.learning_rate_at(s) for s in range(7)]


def test_the_auto_rate_is_the_measured_one_for_smollm2_scaled_by_alpha(base):
    """``learning_rate="auto"`` (the default): 1e-3 for SmolLM2-135M at LoRA alpha 16 (the
    rate behind the catalog's curves), 2e-3 at this module's alpha 8; under a warmup too."""
    assert TrainConfig().learning_rate == "auto"
    default_lora = Policy(base.model, base.tokenizer, LoraConfig(), device=base.device,
                          dtype=base.dtype)
    assert default_lora.auto_learning_rate == 1e-3
    trainer = policy(base)
    assert trainer.auto_learning_rate == pytest.approx(2e-3)
    config = TrainConfig(warmup_steps=1)
    rates = [trainer.optimize(rows(step), config)["learning_rate"] for step in range(2)]
    assert rates == pytest.approx([1e-3, 2e-3])
    with pytest.raises(ValueError, match="depends on the model"):
        config.learning_rate_at(0)


@pytest.mark.parametrize("hidden, family, rate", [(3584, "qwen2", 8.68e-4),
                                                  (4096, "llama", 2.16e-4),
                                                  (2048, "qwen3", 9.06e-4)])
def test_the_auto_rate_of_a_wider_model_follows_the_lora_fit(smollm2_path, hidden, family,
                                                             rate):
    from transformers import AutoConfig

    from tracerl.backend.training.learning_rate import auto_learning_rate

    config = AutoConfig.from_pretrained(smollm2_path)
    config.hidden_size, config.model_type = hidden, family
    assert auto_learning_rate(config, LoraConfig()) == pytest.approx(rate, rel=1e-3)
