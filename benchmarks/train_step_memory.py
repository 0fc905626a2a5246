"""Peak memory (RSS) and seconds of one GRPO training step against the step's total tokens.

A step's memory should be set by its largest micro-batch, not by how many rows it has: this
runs one ``Trainer.optimize`` on ``--rows`` rows of ``--tokens`` tokens each (multi-turn shaped:
a prompt, then completion and tool-result segments, so the trained part starts early in the row)
and reports the process's peak RSS (``VmHWM``) above its RSS before the step, with the step's
seconds. Run it once per step size, each in its own process (peaks never go down)::

    python benchmarks/train_step_memory.py --rows 8 --tokens 1200 [--shape smollm2-135m]
        [--micro-batch-tokens 4096] [--gradient-checkpointing]

``--shape tiny`` is a random-initialised two-layer Llama with SmolLM2's tokenizer and
vocabulary (its logits are SmolLM2's size, its layers a fraction), fast enough for a test of
100+ rows; ``smollm2-135m`` is the real SmolLM2-135M-Instruct weights.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path


def rss_kib(field: str = "VmRSS") -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def tiny_model_dir(tokenizer_from: Path, vocab_size: int = 49152) -> Path:
    """A random-initialised two-layer Llama with ``tokenizer_from``'s tokenizer (ids above
    ``vocab_size`` are not used by the rows here)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_from)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab_size,
                         tie_word_embeddings=True, max_position_embeddings=8192,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    out = Path(tempfile.mkdtemp(prefix="tracerl-tiny-"))
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def rows(n: int, tokens: int, seed: int = 0, vocab: int = 40000) -> list:
    """Rows shaped like merged multi-turn calls: a 10% prompt, then alternating completion
    (trained) and tool-result (not trained) segments of 64 tokens."""
    from tracerl.backend.training.rows import NAN, Row

    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = tokens // 10
        mask = [False] * prompt + [((j // 64) % 2 == 0) for j in range(tokens - prompt)]
        out.append(Row(input_ids=[rng.randrange(vocab // 40, vocab) for _ in range(tokens)],
                       loss_mask=mask,
                       old_logprobs=[-2.0 if m else NAN for m in mask],
                       temperatures=[1.0] * tokens, advantage=1.0 if i % 2 else -1.0))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1200, help="tokens per row")
    parser.add_argument("--micro-batch-tokens", type=int, default=4096)
    parser.add_argument("--shape", choices=["tiny", "smollm2-135m"], default="tiny")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--vocab", type=int, default=49152,
                        help="the tiny shape's vocabulary (SmolLM2's by default)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import torch

    from tracerl.backend.training.trainer import Trainer
    from tracerl.backend.weights import resolve_base_model
    from tracerl.core.config import LoraConfig, TrainConfig

    torch.set_num_threads(args.threads)
    smollm2 = resolve_base_model("smollm2")
    path = tiny_model_dir(smollm2, args.vocab) if args.shape == "tiny" else smollm2
    trainer = Trainer(path, LoraConfig(), device="cpu")
    data = rows(args.rows, args.tokens, vocab=args.vocab if args.shape == "tiny" else 40000)
    before = rss_kib()
    started = time.perf_counter()
    metrics = trainer.optimize(data, TrainConfig(
        micro_batch_tokens=args.micro_batch_tokens,
        gradient_checkpointing=args.gradient_checkpointing))
    seconds = time.perf_counter() - started
    peak = rss_kib("VmHWM")
    print(json.dumps({
        "shape": args.shape, "vocab": args.vocab if args.shape == "tiny" else 49152,
        "rows": args.rows, "tokens_per_row": args.tokens,
        "step_tokens": args.rows * args.tokens, "micro_batches": metrics["micro_batches"],
        "micro_batch_tokens": args.micro_batch_tokens,
        "gradient_checkpointing": args.gradient_checkpointing,
        "rss_before_gib": round(before / 2**20, 3), "peak_rss_gib": round(peak / 2**20, 3),
        "step_peak_gib": round((peak - before) / 2**20, 3),
        "rss_after_gib": round(rss_kib() / 2**20, 3), "seconds": round(seconds, 1)}))


if __name__ == "__main__":
    main()
