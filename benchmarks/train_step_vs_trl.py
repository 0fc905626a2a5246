"""Training-step throughput: tracerl's GRPO step versus TRL's GRPO loss step, same model and batch.

Both sides do forward, loss, backward and an AdamW step on the same LoRA model and the same
random batch, alternating, after a warm-up; the ratio is tokens/s(tracerl) / tokens/s(TRL).

    python benchmarks/train_step_vs_trl.py [--model smollm2|PATH] [--batch 8] [--prompt 64]
        [--completion 64] [--repeats 3] [--random-init qwen2.5-0.5b]

``--waves W --turn-dir DIR --turn-role I --turn-roles K``: K such processes share one GPU and take
turns (warm-up, then W waves of ``--repeats`` timed steps per side, then the matmul rate), each
emptying its allocator cache before handing over, so that a side that cannot share a process
with another (Unsloth's, which replaces TRL's trainer) still alternates with it wave by wave
(``benchmarks/gpu/train_waves.py`` starts the processes and computes per-wave ratios).

MFU: a LoRA step on a frozen base does forward 2N and the input-gradient backward 2N FLOPs per
token (no weight gradients for frozen weights; recomputation by gradient checkpointing is not
counted, as MFU does not count it). Reported with N = all parameters (``*_mfu``, as before) and
with N = the matmul parameters (``*_mfu_matmul``: all but the input embedding, whose lookup is no
matmul; the LM head counts), against the measured bf16 matmul rate and against the 989 TFLOP/s
dense bf16 datasheet rate of the H100/H200 SXM (``*_spec``). Attention's own FLOPs (score and
value products, ~6·S·d·L per token with causal masking, ~2.5% here) are left out.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch
from random_models import SHAPES, random_model_dir


def matmul_tflops(device: torch.device, n: int = 8192, repeats: int = 20) -> float:
    """Measured dense bf16 (CUDA) or fp32 (CPU) matmul rate, the denominator of MFU."""
    if device.type == "cpu":
        n, repeats, dtype = 1024, 5, torch.float32
    else:
        dtype = torch.bfloat16
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(repeats):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize()
    return 2 * n**3 * repeats / (time.perf_counter() - t) / 1e12


SPEC_BF16_TFLOPS = 989.0  # H100/H200 SXM dense bf16, datasheet


class Turns:
    """Processes that take turns on one GPU: turn t belongs to role t % roles. The turn number
    lives in a file, replaced atomically by whoever hands the turn over."""

    def __init__(self, folder: str | None, role: int, roles: int, timeout_s: float = 420) -> None:
        self.path = Path(folder) / "turn" if folder else None
        self.role, self.roles, self.timeout_s = role, roles, timeout_s
        self.turn = role

    def wait(self) -> None:
        if self.path is None:
            return
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                if int(self.path.read_text() or "-1") == self.turn:
                    return
            except (FileNotFoundError, ValueError):
                if self.turn == 0:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"turn {self.turn} never came (the other process died?)")
            time.sleep(0.002)

    def done(self) -> None:
        if self.path is None:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # the other process gets the memory for its turn
        tmp = self.path.with_suffix(f".{self.role}")
        tmp.write_text(str(self.turn + 1))
        tmp.replace(self.path)
        self.turn += self.roles


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--random-init", choices=sorted(SHAPES))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--completion", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokenizer", help="tokenizer folder for --random-init (default: SmolLM2's)")
    ap.add_argument("--json", help="also write the result here")
    ap.add_argument("--waves", type=int, default=1,
                    help="waves of --repeats timed steps per side; with --turn-dir, other "
                    "processes take their turn between waves")
    ap.add_argument("--turn-dir", help="folder of the turn file shared with the other processes")
    ap.add_argument("--turn-role", type=int, default=0)
    ap.add_argument("--turn-roles", type=int, default=1)
    ap.add_argument("--no-trl", action="store_true", help="time tracerl's step alone")
    ap.add_argument("--profile", action="store_true",
                    help="print the top kernels of one step of each side (torch.profiler)")
    args = ap.parse_args()

    if not args.no_trl:  # a process that times tracerl alone imports no TRL, as tracerl doesn't
        import trl
        from datasets import Dataset

    from tracerl import LoraConfig, TrainConfig
    from tracerl.backend.training.rows import Row
    from tracerl.backend.training.trainer import Trainer
    from tracerl.backend.training.update import micro_batches
    from tracerl.backend.weights import resolve_base_model

    if args.random_init:
        tok = Path(args.tokenizer) if args.tokenizer else resolve_base_model("smollm2")
        path = random_model_dir(args.random_init, tok)
    else:
        path = resolve_base_model("smollm2") if args.model == "smollm2" else Path(args.model)
    turns = Turns(args.turn_dir, args.turn_role, args.turn_roles)
    ours = Trainer(path, LoraConfig(r=16, alpha=32))
    model, device = ours.model, ours.device
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    B, P, C = args.batch, args.prompt, args.completion
    prompt = torch.randint(100, min(vocab, 30000), (1, P), generator=g).repeat(B, 1)
    completion = torch.randint(100, min(vocab, 30000), (B, C), generator=g)
    adv = torch.randn(B, generator=g)
    old = -torch.rand(B, C, generator=g) * 3

    cfg = TrainConfig(learning_rate=1e-5, loss_normalization="token",
                      micro_batch_tokens=B * (P + C))
    rows = [Row(input_ids=prompt[b].tolist() + completion[b].tolist(),
                loss_mask=[False] * P + [True] * C,
                old_logprobs=[math.nan] * P + old[b].tolist(), temperatures=[1.0] * (P + C),
                advantage=float(adv[b])) for b in range(B)]
    batches = micro_batches(rows, cfg.micro_batch_tokens)

    if not args.no_trl:
        targs = trl.GRPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=B,
                               num_generations=B, loss_type="bnpo", beta=0.0, report_to=[],
                               bf16=device.type == "cuda", use_cpu=device.type == "cpu",
                               max_completion_length=C)
        tt = trl.GRPOTrainer(model=model,
                             reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
                             args=targs, train_dataset=Dataset.from_list([{"prompt": "x"}] * B),
                             processing_class=ours.tokenizer)
        tt.current_gradient_accumulation_steps = 1
    inputs = {k: v.to(device) for k, v in {
        "prompt_ids": prompt, "prompt_mask": torch.ones_like(prompt), "completion_ids": completion,
        "completion_mask": torch.ones_like(completion), "advantages": adv,
        "old_per_token_logps": old}.items()}
    opt = ours.optimizer
    model.train()

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def step_ours() -> None:
        opt.zero_grad(set_to_none=True)
        ours.backward(batches, cfg, collect=False)
        opt.step()

    def step_trl() -> None:
        opt.zero_grad(set_to_none=True)
        tt._compute_loss(model, inputs).backward()
        opt.step()

    def timed(fn) -> float:
        sync()
        t = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t

    turns.wait()
    step_ours()  # warm-up
    trl_error = "not asked for (--no-trl)" if args.no_trl else None
    if trl_error is None:
        try:
            step_trl()
        except Exception as e:
            # Unsloth replaces TRL's GRPOTrainer with its own, which wants more inputs
            trl_error = f"{type(e).__name__}: {e}"
            print(f"TRL's loss step failed ({trl_error}); timing tracerl alone", flush=True)
    turns.done()
    if args.profile:
        from torch.profiler import ProfilerActivity, profile
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        for name, fn in (("tracerl", step_ours), ("trl", step_trl)):
            with profile(activities=acts) as prof:
                timed(fn)
            key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
            print(f"== {name}\n" + prof.key_averages().table(sort_by=key, row_limit=18))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    tokens = B * (P + C)
    t_ours, t_trl, t_build = [], [], []
    wave_ours, wave_trl = [], []
    for wave in range(args.waves):
        turns.wait()
        if args.turn_dir:  # the allocator's cache was emptied for the other process: refill
            step_ours()
            if trl_error is None:
                step_trl()
        w_ours, w_trl = [], []
        for _ in range(args.repeats):
            w_ours.append(timed(step_ours))
            if trl_error is None:
                w_trl.append(timed(step_trl))
            # host-side tensor building is part of our step (rows -> padded tensors); TRL's
            # inputs arrive ready, so it is also reported on its own
            t_build.append(timed(lambda: [ours.tensors(b) for b in batches]))
        turns.done()
        t_ours += w_ours
        t_trl += w_trl
        wave_ours.append(tokens / statistics.median(w_ours))
        if w_trl:
            wave_trl.append(tokens / statistics.median(w_trl))
        print(json.dumps({"wave": wave, "tracerl_tokens_per_s": wave_ours[-1],
                          "trl_tokens_per_s": wave_trl[-1] if w_trl else None}), flush=True)
    result = {
        "model": args.random_init or str(args.model), "device": str(device), "batch": B,
        "prompt": P, "completion": C, "tokens_per_step": tokens, "trainer_backend": ours.backend,
        "tracerl_tokens_per_s": tokens / statistics.median(t_ours),
        "tracerl_tensor_build_ms": 1000 * statistics.median(t_build),
        "waves": args.waves, "repeats_per_wave": args.repeats,
        "tracerl_waves_tokens_per_s": wave_ours,
    }
    if trl_error is None:
        result["trl_tokens_per_s"] = tokens / statistics.median(t_trl)
        result["trl_waves_tokens_per_s"] = wave_trl
        result["ratio_tracerl_over_trl"] = (
            result["tracerl_tokens_per_s"] / result["trl_tokens_per_s"])
        result["ratio_without_tensor_build"] = statistics.median(t_trl) / (
            statistics.median(t_ours) - statistics.median(t_build))
    else:
        result["trl_error"] = trl_error
    # LoRA step FLOPs: forward 2N + input-gradient backward 2N per token (frozen weights get no
    # weight gradients); attention and the small LoRA matrices are left out (module docstring).
    n_params = sum(p.numel() for p in model.parameters())
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight.data_ptr() == embed.data_ptr()
    # the input embedding is a lookup; when tied, its matrix is also the LM head's matmul
    n_matmul = n_params - (0 if tied else embed.numel())
    turns.wait()
    peak = matmul_tflops(device)
    turns.done()
    for side in ("tracerl", "trl") if trl_error is None else ("tracerl",):
        achieved = 4 * n_params * result[f"{side}_tokens_per_s"] / 1e12
        result[f"{side}_mfu"] = achieved / peak
        matmul = 4 * n_matmul * result[f"{side}_tokens_per_s"] / 1e12
        result[f"{side}_tflops_matmul"] = matmul
        result[f"{side}_mfu_matmul"] = matmul / peak
        result[f"{side}_mfu_matmul_spec"] = matmul / SPEC_BF16_TFLOPS
    result["params"] = n_params
    result["params_matmul"] = n_matmul
    result["matmul_tflops_measured"] = peak
    result["spec_bf16_tflops"] = SPEC_BF16_TFLOPS
    if device.type == "cuda":
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
