"""A training step's memory is set by its micro-batch, not by how many rows the step has.

The model is a random-initialised two-layer Llama with SmolLM2's tokenizer (SmolLM2-135M itself
runs a 200k-token step in tens of minutes on the 2-core CI box; its numbers are in
BENCHMARKS.md, from ``benchmarks/train_step_memory.py``)."""

from __future__ import annotations

import json
import subprocess
import sys
import weakref
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "train_step_memory.py"
# the stated bound: a step of 100 rows x 2,048 tokens (50 micro-batches of 4,096 tokens) of the
# tiny shape with an 8,192-token vocabulary stays within this above the RSS before the step
STEP_PEAK_BOUND_GIB = 1.0


def _tiny_model(tokenizer_from: Path, out: Path, vocab: int) -> Path:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_from)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.mark.parametrize("fused", [False, True])
def test_no_micro_batchs_logits_outlive_it(smollm2_path, tmp_path, fused):
    """The LM head's output of one micro-batch is gone before the next one's forward (it
    lived on into the next micro-batch: two micro-batches' logits at once); the chunked head
    (``training/head.py``, the default) never runs the head module at all."""
    import torch

    from tracerl.backend.training.rows import NAN, Row
    from tracerl.backend.training.trainer import Trainer
    from tracerl.core.config import LoraConfig, TrainConfig

    trainer = Trainer(_tiny_model(smollm2_path, tmp_path / "tiny", 4096), LoraConfig(),
                      device="cpu")
    trainer.fused_head = fused
    outputs: list[weakref.ref[torch.Tensor]] = []
    alive_at_each_forward: list[int] = []
    head = trainer.model.get_output_embeddings()
    head.register_forward_pre_hook(
        lambda module, args: alive_at_each_forward.append(
            sum(ref() is not None for ref in outputs)))
    head.register_forward_hook(lambda module, args, out: outputs.append(weakref.ref(out)))
    rows = [Row(input_ids=list(range(100 + i, 700 + i)), loss_mask=[False] * 100 + [True] * 500,
                old_logprobs=[NAN] * 100 + [-3.0] * 500, temperatures=[1.0] * 600,
                advantage=1.0 if i % 2 else -1.0) for i in range(6)]
    metrics = trainer.optimize(rows, TrainConfig(micro_batch_tokens=1200))
    assert metrics["micro_batches"] == 3
    assert alive_at_each_forward == ([] if fused else [0, 0, 0])


def _step(rows: int, tokens: int) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--rows", str(rows), "--tokens", str(tokens),
         "--vocab", "8192", "--micro-batch-tokens", "4096"],
        capture_output=True, text=True, timeout=1200, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.timeout(1800)  # two steps in subprocesses, 200k tokens on 2 cores
def test_a_step_of_100_rows_of_2k_tokens_stays_within_one_micro_batchs_memory():
    one = _step(rows=2, tokens=2048)  # one micro-batch of 4,096 tokens
    step = _step(rows=100, tokens=2048)  # 50 of them
    assert one["micro_batches"] == 1 and step["micro_batches"] == 50
    assert step["step_peak_gib"] <= STEP_PEAK_BOUND_GIB, step
    # the peak of 50 micro-batches is that of one, give or take the allocator's slack
    assert step["step_peak_gib"] <= 1.2 * one["step_peak_gib"] + 0.1, (one, step)
