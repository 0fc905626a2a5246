"""CPU MFU of a GRPO training step: its FLOP/s over this machine's own fp32 matmul rate.

One run measures both, interleaved (the box is shared: a rate measured at another time would
not be the bound the step ran against): the matmul rate before the first step and after each
step, each step's MFU taken against the mean of the two rates around it. The step is
``Trainer.optimize`` of SmolLM2-135M-Instruct (real weights) on rows shaped like the tool
agent's after exact turns (one row per rollout: a long prompt of system message, tool schema
and question, then a tool call (trained), the tool's result (not trained) and the answer
(trained); ~8% of tokens trained, as the catalog's ``tool-products`` steps have)::

    python benchmarks/train_step_mfu.py [--rows 8] [--mean-tokens 500] [--threads 2]
        [--micro-batch-tokens 2048] [--rounds 3] [--variants peft-lora,default,threads1,eager]

The variants run in turn, ``--rounds`` times (the box's load changes: a variant is compared
with the default step of its own round), then one ``profile`` step.

**The matmul rate** is ``torch.mm`` over one decoder layer's projection shapes (q, k, v, o,
gate, up, down) at the step's largest micro-batch of tokens, forward (``x @ W^T``) and input
gradient (``dy @ W``), at the step's thread count: the FLOP/s the body's GEMMs could reach.

**The step's FLOPs** count useful work only (pad tokens count nothing). A LoRA step trains no
base weight, so its backward computes input gradients only; with ``T`` the step's tokens, ``Y``
its trained tokens, ``L`` layers, ``H`` hidden size, ``d`` = heads x head_dim, ``V`` vocab::

    body      = 4 x P x T - 2 x P_qkv0 x T   P: the decoder's projection weights (L x 7 matrices);
                                              2 forward + 2 input gradient a weight and token;
                                              layer 0's q, k, v need no input gradient (their
                                              input is the frozen embedding)
    attention = 6 x L x d x sum_rows n(n+1)  causal QK^T and PV: 2 d n(n+1) forward, twice
                                              that for their input gradients
    lora      = 6 x r x sum(in + out) x L x T  forward, input gradient, weight gradient
    head      = 4 x V x H x Y                the chunked head (training/head.py): the logits
                                              and, in the same pass, the Jacobian p W; its
                                              backward is elementwise

Variants (each one step): ``default``; ``profile`` (the default step under ``torch.profiler``:
time in GEMMs, attention, other ops (the top ones named), the optimizer, and outside ops);
``threads1`` (one torch thread, against the ``--threads`` matmul rate: the machine's bound);
``eager`` (``eager`` attention instead of ``sdpa``); ``old-logprobs`` (rows without engine
logprobs: the ``fill_old_logprobs`` pass runs); ``kl`` (``beta=0.04``: the reference pass runs);
``peft-lora`` (peft's own LoRA layers, as before ``training/fused_lora.py``: before/after in
one run); ``padding-mask`` (the padding mask passed to attention, as before the rows went
through plain causal attention: ``Trainer.causal_without_padding_mask``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch

from benchmarks.train_step_memory import rows as memory_rows

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tool_rows(n: int, mean_tokens: int, seed: int = 0, spread: float = 0.15,
              turns: tuple[int, int, int] = (24, 40, 20), old_logprobs: bool = True) -> list:
    """``n`` rows of the tool agent's shape, lengths ``mean_tokens`` +- ``spread``: a prompt,
    then ``turns`` = (tool call, tool result, answer) tokens, the call and answer trained. Ids
    and fields from ``train_step_memory.rows``; ``old_logprobs`` False: NaN (no engine
    logprobs, as a row rendered from messages)."""
    from tracerl.backend.training.rows import NAN

    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = round(mean_tokens * (1 + rng.uniform(-spread, spread)))
        row = memory_rows(1, length, seed=seed * 1000 + i)[0]
        call, result, answer = turns
        row.loss_mask = ([False] * (length - call - result - answer) + [True] * call
                         + [False] * result + [True] * answer)
        row.old_logprobs = [-2.0 if m and old_logprobs else NAN for m in row.loss_mask]
        row.advantage = 1.0 if i % 2 else -1.0
        out.append(row)
    return out


def projection_shapes(config: Any) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection of a Llama-style decoder layer."""
    h, d = config.hidden_size, config.num_attention_heads * config.head_dim
    kv, i = config.num_key_value_heads * config.head_dim, config.intermediate_size
    return {"q_proj": (h, d), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (d, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def step_flops(config: Any, lora_r: int, targets: list[str], rows: list) -> dict[str, float]:
    """The step's useful FLOPs by term (the module docstring's formula)."""
    shapes = projection_shapes(config)
    layers, tokens = config.num_hidden_layers, sum(len(r) for r in rows)
    p = layers * sum(i * o for i, o in shapes.values())
    qkv0 = sum(i * o for k, (i, o) in shapes.items() if k in ("q_proj", "k_proj", "v_proj"))
    d = config.num_attention_heads * config.head_dim
    terms = {
        "body": 4 * p * tokens - 2 * qkv0 * tokens,
        "attention": 6 * layers * d * sum(len(r) * (len(r) + 1) for r in rows),
        "lora": 6 * lora_r * sum(i + o for k, (i, o) in shapes.items() if k in targets)
        * layers * tokens,
        "head": 4 * config.vocab_size * config.hidden_size * sum(r.trained_tokens for r in rows),
    }
    return {k: float(v) for k, v in terms.items()} | {"total": float(sum(terms.values()))}


def matmul_rate(config: Any, tokens: int, seconds: float = 3.0) -> dict[str, float]:
    """GFLOP/s of ``torch.mm`` over one layer's projection shapes at ``tokens`` rows, forward
    and input gradient, repeated for ``seconds``: the median and spread of the repeats."""
    torch.manual_seed(0)
    mats = [(torch.randn(tokens, i), torch.randn(o, i), torch.randn(tokens, o))
            for i, o in projection_shapes(config).values()]
    flops = sum(4 * tokens * w.shape[0] * w.shape[1] for _, w, _ in mats)
    rates: list[float] = []
    deadline = time.perf_counter() + seconds
    for _ in range(2):  # warm-up
        _layer_mms(mats)
    while time.perf_counter() < deadline or len(rates) < 3:
        started = time.perf_counter()
        _layer_mms(mats)
        rates.append(flops / (time.perf_counter() - started) / 1e9)
    return {"gflops": statistics.median(rates), "min": min(rates), "max": max(rates),
            "repeats": len(rates)}


def _layer_mms(mats: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
    for x, w, dy in mats:
        torch.mm(x, w.t())
        torch.mm(dy, w)


def padding(rows: list, micro_batch_tokens: int) -> dict[str, float]:
    """Pad tokens over all tokens of the step's micro-batches, as the trainer cuts them."""
    from tracerl.backend.training.update import micro_batches

    batches = micro_batches(rows, micro_batch_tokens)
    padded = sum(len(b) * max(len(r) for r in b) for b in batches)
    return {"micro_batches": len(batches), "padded_tokens": padded,
            "pad_fraction": 1 - sum(len(r) for r in rows) / padded,
            "largest": max(len(b) * max(len(r) for r in b) for b in batches)}


@contextlib.contextmanager
def variant(name: str, trainer: Any, threads: int) -> Iterator[None]:
    """The trainer set up as variant ``name`` for one step (the data and config are set by
    :func:`run_step`)."""
    from tracerl.backend.training import fused_lora

    if name == "threads1":
        torch.set_num_threads(1)
    elif name == "eager":
        trainer.model.set_attn_implementation("eager")
    elif name == "peft-lora":
        fused_lora.uninstall(trainer.model)
    elif name == "padding-mask":
        trainer.causal_without_padding_mask = False
    try:
        yield
    finally:
        trainer.causal_without_padding_mask = True
        torch.set_num_threads(threads)
        trainer.model.set_attn_implementation("sdpa")
        fused_lora.install(trainer.model)


def run_step(trainer: Any, name: str, args: argparse.Namespace, threads: int
             ) -> tuple[float, list, dict[str, float] | None]:
    """One step of variant ``name``: its seconds, its rows, and (``profile``) where its time
    went."""
    from tracerl.core.config import TrainConfig

    rows = tool_rows(args.rows, args.mean_tokens, seed=args.seed,
                     old_logprobs=name != "old-logprobs")
    config = TrainConfig(micro_batch_tokens=args.micro_batch_tokens,
                         beta=0.04 if name == "kl" else 0.0)
    with variant(name, trainer, threads), contextlib.ExitStack() as stack:
        prof = None
        if name == "profile":
            from torch.profiler import ProfilerActivity, profile
            prof = stack.enter_context(profile(activities=[ProfilerActivity.CPU]))
        started = time.perf_counter()
        trainer.optimize(rows, config)
        seconds = time.perf_counter() - started
    return seconds, rows, (None if prof is None else breakdown(prof, seconds))


def breakdown(prof: Any, seconds: float) -> dict[str, Any]:
    """Seconds of the profiled step by kind: GEMMs, the attention kernel, other aten ops
    (elementwise, copies, reductions; the top ones named), the optimizer step, and outside
    ops (Python, autograd)."""
    out = dict.fromkeys(("gemm", "attention", "other_ops", "optimizer"), 0.0)
    others: dict[str, float] = {}
    for e in prof.key_averages():
        s = e.self_cpu_time_total / 1e6
        if e.key.startswith("Optimizer.step"):
            out["optimizer"] += e.cpu_time_total / 1e6
        elif not e.key.startswith("aten::"):
            continue
        elif e.key in ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm"):
            out["gemm"] += s
        elif "scaled_dot_product" in e.key or e.key == "aten::_softmax":
            out["attention"] += s
        else:
            out["other_ops"] += s
            others[e.key] = s
    out["other_ops"] -= out["optimizer"]  # the optimizer's aten ops are in its total
    out["outside_ops"] = seconds - sum(out.values())
    top = sorted(others.items(), key=lambda kv: -kv[1])[:8]
    return {**{k: round(v, 2) for k, v in out.items()},
            "top_other_ops": {k: round(v, 2) for k, v in top}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--mean-tokens", type=int, default=500)
    parser.add_argument("--micro-batch-tokens", type=int, default=2048,
                        help="2,048: a 4,096-token micro-batch of SmolLM2 needs ~10 GiB")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--matmul-seconds", type=float, default=4.0)
    parser.add_argument("--variants", default="peft-lora,default,threads1,eager")
    parser.add_argument("--rounds", type=int, default=3, help="the variants, in turn, this "
                        "many times (then one profiled step)")
    args = parser.parse_args()
    measure(args)


def measure(args: argparse.Namespace) -> None:
    from tracerl.backend.training.trainer import Trainer
    from tracerl.backend.weights import resolve_base_model
    from tracerl.core.config import LoraConfig, TrainConfig

    torch.set_num_threads(args.threads)
    lora = LoraConfig()
    trainer = Trainer(resolve_base_model("smollm2"), lora, device="cpu")
    config = trainer.model.get_base_model().config
    shape = tool_rows(args.rows, args.mean_tokens, seed=args.seed)
    pad = padding(shape, args.micro_batch_tokens)
    flops = step_flops(config, lora.r, list(lora.target_modules), shape)
    print(json.dumps({"rows": len(shape), "tokens": sum(len(r) for r in shape),
                      "trained_tokens": sum(r.trained_tokens for r in shape), **pad,
                      "gflop": {k: round(v / 1e9, 1) for k, v in flops.items()}}), flush=True)
    trainer.optimize(tool_rows(2, 128, seed=99), TrainConfig())  # warm-up: first-call costs
    rate = matmul_rate(config, pad["largest"], args.matmul_seconds)["gflops"]
    results: list[dict[str, Any]] = []
    for round_ in range(args.rounds + 1):
        names = args.variants.split(",") if round_ < args.rounds else ["profile"]
        for name in names:
            seconds, rows, where = run_step(trainer, name, args, args.threads)
            after = matmul_rate(config, pad["largest"], args.matmul_seconds)["gflops"]
            achieved = step_flops(config, lora.r, list(lora.target_modules), rows)["total"] \
                / seconds / 1e9
            results.append({"round": round_, "variant": name, "seconds": round(seconds, 1),
                            "gflops": round(achieved, 1),
                            "matmul_gflops_before_after": [round(rate, 1), round(after, 1)],
                            "mfu": round(achieved / ((rate + after) / 2), 3),
                            **({"breakdown_s": where} if where else {})})
            print(json.dumps(results[-1]), flush=True)
            rate = after
    print(json.dumps(summary(results, args.threads)), flush=True)


def summary(results: list[dict[str, Any]], threads: int) -> dict[str, Any]:
    """Per variant: median and range of its MFU and seconds; its step time over the default's
    in the same round (paired: the box's load changes between rounds)."""
    out: dict[str, Any] = {"threads": threads, "matmul_gflops_range": [
        min(min(r["matmul_gflops_before_after"]) for r in results),
        max(max(r["matmul_gflops_before_after"]) for r in results)]}
    for name in dict.fromkeys(r["variant"] for r in results):
        mine = [r for r in results if r["variant"] == name]
        ratios = [r["seconds"] / d["seconds"] for r in mine for d in results
                  if d["variant"] == "default" and d["round"] == r["round"]]
        out[name] = {"mfu_median": statistics.median(r["mfu"] for r in mine),
                     "mfu_range": [min(r["mfu"] for r in mine), max(r["mfu"] for r in mine)],
                     "seconds_median": statistics.median(r["seconds"] for r in mine),
                     "seconds_over_default": [round(x, 3) for x in ratios]}
    return out


if __name__ == "__main__":
    main()
