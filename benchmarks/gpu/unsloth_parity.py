"""Does the Unsloth trainer compute the same GRPO step as the peft trainer? (GPU only)

One process, one random-initialised Qwen2.5-shaped model, one random batch: the peft trainer
(plain transformers + peft) and the Unsloth trainer (FastLanguageModel) get the same LoRA
weights (B randomised so both A and B have gradients), then one forward/backward each.
Reported: loss of each, mean |logprob difference| on trained tokens, and per-tensor gradient
cosine similarity and relative norm difference (bf16 kernels differ, so not bit-equal).

    python3 benchmarks/gpu/unsloth_parity.py --shape qwen2.5-0.5b --tokenizer .whl/tok
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from train_step_vs_trl import random_model_dir


def lora_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().float().clone() for n, p in model.named_parameters()
            if "lora_" in n and p.grad is not None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--json")
    args = ap.parse_args()

    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    from tracerl import LoraConfig, TrainConfig
    from tracerl.backend.training.rows import Row
    from tracerl.backend.training.trainer import Trainer
    from tracerl.backend.training.update import micro_batches

    path = random_model_dir(args.shape, Path(args.tokenizer))
    lora = LoraConfig(r=16, alpha=32)
    os.environ["TRACERL_DISABLE_UNSLOTH"] = "1"
    peft = Trainer(path, lora)
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in peft.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    g = torch.Generator().manual_seed(0)
    B, L, P = args.batch, args.length, args.length // 2
    ids = torch.randint(100, 30000, (B, L), generator=g)
    rows = [Row(input_ids=ids[b].tolist(), loss_mask=[False] * P + [True] * (L - P),
                old_logprobs=[math.nan] * L, temperatures=[1.0] * L,
                advantage=float(torch.randn(1, generator=g))) for b in range(B)]
    cfg = TrainConfig(micro_batch_tokens=B * L)
    batches = micro_batches(rows, cfg.micro_batch_tokens)
    peft.fill_old_logprobs(batches)  # old = the peft policy's logprobs
    peft.model.train()
    peft.optimizer.zero_grad(set_to_none=True)
    sums_peft = peft.backward(batches, cfg)
    grads_peft = lora_grads(peft.model)
    state = get_peft_model_state_dict(peft.model)
    peft.model.to("cpu")
    torch.cuda.empty_cache()

    del os.environ["TRACERL_DISABLE_UNSLOTH"]
    uns = Trainer(path, lora)
    assert uns.backend == "unsloth", uns.backend
    result = set_peft_model_state_dict(uns.model, {k: v.to(uns.device) for k, v in state.items()})
    uns.model.train()
    uns.optimizer.zero_grad(set_to_none=True)
    sums_uns = uns.backward(batches, cfg)
    grads_uns = lora_grads(uns.model)

    trained = sum(r.trained_tokens for r in rows)
    common = sorted(set(grads_peft) & set(grads_uns))
    cos, rel = [], []
    for n in common:
        a, b = grads_peft[n].flatten(), grads_uns[n].flatten()
        cos.append(float(torch.nn.functional.cosine_similarity(a, b, dim=0)))
        rel.append(float((a - b).norm() / a.norm().clamp_min(1e-12)))
    out = {
        "shape": args.shape, "tokens": B * L, "trained_tokens": trained,
        "loss_peft": sums_peft["loss"], "loss_unsloth": sums_uns["loss"],
        "mean_abs_logprob_diff": sums_uns["logprob_mismatch"] / trained,
        "lora_tensors_peft": len(grads_peft), "lora_tensors_unsloth": len(grads_uns),
        "lora_tensors_compared": len(common),
        "unexpected_keys_loading_into_unsloth": len(getattr(result, "unexpected_keys", []) or []),
        "grad_cosine_min": min(cos), "grad_cosine_median": sorted(cos)[len(cos) // 2],
        "grad_rel_diff_median": sorted(rel)[len(rel) // 2], "grad_rel_diff_max": max(rel),
    }
    print(json.dumps(out, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
