"""Peak memory (RSS) and seconds of one GRPO training step against the step's total tokens.

A step's memory should be set by its largest micro-batch, not by how many rows it has: this
runs one ``Trainer.optimize`` on ``--rows`` rows of ``--tokens`` tokens each (multi-turn shaped:
a prompt, then completion and tool-result segments, so the trained part starts early in the row)
and reports the process's peak RSS (``VmHWM``) above its RSS before the step, with the step's
seconds (``--warmup`` steps first, then ``--steps`` measured: the highest peak, the median
seconds; the learning rate is 1e-9, so every step trains the same weights). Run it once per
step size, each in its own process (peaks never go down)::

    python benchmarks/train_step_memory.py --rows 8 --tokens 1200 [--shape smollm2-135m]
        [--micro-batch-tokens 4096] [--gradient-checkpointing auto|on|off] [--head chunked|full]
        [--compare]

``--head full`` is the materialised-logits path (``Policy.fused_head = False``: the
``[tokens, vocab]`` logits of every kept position), ``chunked`` the default (``head.py``).
``--compare`` runs the peer, ``--head full --gradient-checkpointing off`` (the step before
issue 40), then today's default, ``--head chunked --gradient-checkpointing auto``, each in a
process of its own, and prints each one's line and their ratios (peak per micro-batch token,
seconds). The peak is ``VmHWM`` reset just before the step (``/proc/self/clear_refs``), so the
model's loading does not count.

``--shape tiny`` is a random-initialised two-layer Llama with SmolLM2's tokenizer and
vocabulary (its logits are SmolLM2's size, its layers a fraction), fast enough for a test of
100+ rows; ``smollm2-135m`` is the real SmolLM2-135M-Instruct weights.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
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


def reset_peak() -> bool:
    """Reset the process's ``VmHWM`` to its RSS now (Linux 4.0+); False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


PEER = ["--head", "full", "--gradient-checkpointing", "off"]
NEW = ["--head", "chunked", "--gradient-checkpointing", "auto"]


def compare(argv: list[str]) -> None:
    """The peer's step, then today's, each in a fresh process; their lines and ratios."""
    results = []
    for side in (PEER, NEW):
        out = subprocess.run([sys.executable, __file__, *argv, *side], check=True,
                             capture_output=True, text=True).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
        print(json.dumps(results[-1]), flush=True)
    peer, new = results
    print(json.dumps({
        "compare": "chunked head + auto checkpointing vs materialised logits, no checkpointing",
        "peak_mb_per_token": [peer["peak_mb_per_token"], new["peak_mb_per_token"]],
        "peak_ratio": round(new["step_peak_gib"] / peer["step_peak_gib"], 3),
        "seconds_ratio": round(new["seconds"] / peer["seconds"], 3)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1200, help="tokens per row")
    parser.add_argument("--micro-batch-tokens", type=int, default=4096)
    parser.add_argument("--shape", choices=["tiny", "smollm2-135m"], default="tiny")
    parser.add_argument("--gradient-checkpointing", choices=["auto", "on", "off"],
                        default="auto")
    parser.add_argument("--head", choices=["chunked", "full"], default="chunked")
    parser.add_argument("--compare", action="store_true",
                        help="the peer (full head, no checkpointing) then the default")
    parser.add_argument("--vocab", type=int, default=49152,
                        help="the tiny shape's vocabulary (SmolLM2's by default)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=0,
                        help="steps before the measured ones (their peak is not counted)")
    parser.add_argument("--steps", type=int, default=1,
                        help="measured steps: the highest peak, the median seconds")
    args = parser.parse_args()
    if args.compare:
        argv = sys.argv[1:]
        argv.remove("--compare")
        compare(argv)
        return

    import torch

    from tracerl.backend.training.trainer import Trainer
    from tracerl.backend.training.update import micro_batches
    from tracerl.backend.weights import resolve_base_model
    from tracerl.core.config import LoraConfig, TrainConfig

    torch.set_num_threads(args.threads)
    smollm2 = resolve_base_model("smollm2")
    path = tiny_model_dir(smollm2, args.vocab) if args.shape == "tiny" else smollm2
    trainer = Trainer(path, LoraConfig(), device="cpu")
    trainer.fused_head = args.head == "chunked"
    data = rows(args.rows, args.tokens, vocab=args.vocab if args.shape == "tiny" else 40000)
    checkpoint = {"auto": "auto", "on": True, "off": False}[args.gradient_checkpointing]
    config = TrainConfig(micro_batch_tokens=args.micro_batch_tokens,
                         gradient_checkpointing=checkpoint, learning_rate=1e-9)
    for _ in range(args.warmup):
        trainer.optimize(data, config)
    peak_reset = reset_peak()
    before = rss_kib()
    times = []
    for _ in range(args.steps):
        started = time.perf_counter()
        metrics = trainer.optimize(data, config)
        times.append(time.perf_counter() - started)
    seconds = sorted(times)[len(times) // 2]
    peak = rss_kib("VmHWM")
    largest = max(len(b) * max(len(r) for r in b)
                  for b in micro_batches(data, args.micro_batch_tokens))
    print(json.dumps({
        "shape": args.shape, "vocab": args.vocab if args.shape == "tiny" else 49152,
        "rows": args.rows, "tokens_per_row": args.tokens,
        "step_tokens": args.rows * args.tokens, "micro_batches": metrics["micro_batches"],
        "micro_batch_tokens": args.micro_batch_tokens,
        "head": args.head, "gradient_checkpointing": args.gradient_checkpointing,
        "checkpointed_layers": metrics["checkpointed_layers"],
        "activation_estimate_mb": metrics["activation_estimate_mb"],
        "activation_planned_mb": metrics["activation_planned_mb"],
        "peak_reset": peak_reset, "largest_micro_batch_tokens": largest,
        "rss_before_gib": round(before / 2**20, 3), "peak_rss_gib": round(peak / 2**20, 3),
        "step_peak_gib": round((peak - before) / 2**20, 3),
        "peak_mb_per_token": round((peak - before) / 1024 / largest, 3),
        "rss_after_gib": round(rss_kib() / 2**20, 3), "warmup": args.warmup, "steps": args.steps,
        "seconds": round(seconds, 2), "all_seconds": [round(x, 2) for x in times]}))


if __name__ == "__main__":
    main()
