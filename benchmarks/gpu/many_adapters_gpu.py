"""Many adapters on one base on the GPU (issue 43, row 2): a GPU copy of
benchmarks/many_adapters.py (which pins device="cpu" and a tiny-llama shape), measured as
same-process ratios over alternating waves.

One process, one random-initialised model of --shape (benchmarks/random_models.py), LoRA r=8 on
all linear projections, ROWS rows of TOKENS tokens per model (half trained, old logprobs known).
A SharedBase with max(--ns) adapters attached, and a one-adapter peft Trainer of the same model
(what a single model's run trains on with Unsloth off). Each wave times, in a rotating order,
--repeats of each variant (median per wave, torch.cuda.synchronize around each):
  one_shared   policies[0].optimize(its rows)   (the N=1 peer, same process, same base)
  one_alone    Trainer(...).optimize(its rows)  (a single model's own trainer)
  N_mixed      optimize_together(N policies, mixed=True)  (one micro-batch pass over N models)
  N_per        optimize_together(N policies, mixed=False) (train_many's default)
  N_separate   N single-model steps on the shared base one after another
Ratios per wave: N_x / one_shared, N_x / one_alone, N*one_alone / N_x (experiment throughput).

  PYTHONPATH=$PWD:$PWD/benchmarks python3 benchmarks/gpu/many_adapters_gpu.py --shape qwen2.5-0.5b \
      --tokenizer .whl/tok --ns 4,8 --rows 8 --tokens 512 --waves 5 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

os.environ.setdefault("TRACERL_DISABLE_UNSLOTH", "1")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen2.5-0.5b")
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--ns", default="4,8")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--micro", type=int, default=0,
                   help="micro_batch_tokens (0: max N x rows x tokens, at most 16384: a 1.5B "
                   "shape's activations at 32k tokens in one micro-batch would not fit 80 GB)")
    p.add_argument("--waves", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json")
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
    from random_models import random_model_dir

    from tracerl.backend.training.adapters import SharedBase, optimize_together
    from tracerl.backend.training.trainer import Trainer
    from tracerl.core.config import LoraConfig, TrainConfig

    cuda = args.device == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    ns = [int(x) for x in args.ns.split(",")]
    nmax = max(ns)
    micro = args.micro or min(nmax * args.rows * args.tokens, 16384)
    lora = LoraConfig(r=8, alpha=16)
    config = TrainConfig(learning_rate=1e-4, micro_batch_tokens=micro)
    t0 = time.perf_counter()
    model = random_model_dir(args.shape, Path(args.tokenizer))
    shared = SharedBase(model, lora, device=args.device)
    policies = [shared.attach(None) for _ in range(nmax)]
    alone = Trainer(model, lora, device=args.device)
    gpu = torch.cuda.get_device_name(0) if cuda else "cpu"
    print(json.dumps({"shape": args.shape, "gpu": gpu,
                      "torch": torch.__version__, "alone_backend": alone.backend,
                      "rows": args.rows, "tokens": args.tokens, "micro": micro,
                      "load_s": round(time.perf_counter() - t0, 1)}), flush=True)
    from many_adapters import rows  # benchmarks/ is on PYTHONPATH

    data = [rows(args.rows, args.tokens, seed) for seed in range(nmax)]

    def fresh(i):  # optimize mutates rows (adapter, trainer_logprobs): a copy per call
        return [type(r)(list(r.input_ids), list(r.loss_mask), list(r.old_logprobs),
                        list(r.temperatures), advantage=r.advantage) for r in data[i]]

    fns = {"one_shared": lambda: policies[0].optimize(fresh(0), config),
           "one_alone": lambda: alone.optimize(fresh(0), config)}
    for n in ns:
        fns[f"{n}_mixed"] = (lambda n=n: optimize_together(
            policies[:n], [fresh(i) for i in range(n)], config, mixed=True))
        fns[f"{n}_per"] = (lambda n=n: optimize_together(
            policies[:n], [fresh(i) for i in range(n)], config, mixed=False))
        fns[f"{n}_separate"] = (lambda n=n: [policies[i].optimize(fresh(i), config)
                                             for i in range(n)])
    peak = {}
    for name, fn in list(fns.items()):  # warm-up, and each variant's peak GPU memory
        sync()
        cuda and torch.cuda.reset_peak_memory_stats()
        try:
            fn()
        except torch.OutOfMemoryError as e:  # that variant is dropped, the others go on
            print(json.dumps({"oom": name, "error": str(e)[:200]}), flush=True)
            del fns[name]
            torch.cuda.empty_cache()
            continue
        sync()
        peak[name] = round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else 0
    print(json.dumps({"peak_gib": peak}), flush=True)
    names = list(fns)
    waves = []
    for w in range(args.waves):
        order = names[w % len(names):] + names[:w % len(names)]
        if w % 2:
            order = order[::-1]
        samples = {n: [] for n in names}
        for _ in range(args.repeats):
            for name in order:
                sync()
                t = time.perf_counter()
                fns[name]()
                sync()
                samples[name].append(time.perf_counter() - t)
        med = {n: statistics.median(v) for n, v in samples.items()}
        ratios = {}
        for n in ns:
            for kind in ("mixed", "per", "separate"):
                for peer in ("one_shared", "one_alone"):
                    if f"{n}_{kind}" in med and peer in med:
                        ratios[f"{n}_{kind}/{peer}"] = med[f"{n}_{kind}"] / med[peer]
            shared = [med[k] for k in (f"{n}_mixed", f"{n}_per") if k in med]
            if shared and "one_alone" in med:
                ratios[f"{n}_throughput_vs_alone_runs"] = n * med["one_alone"] / min(shared)
        wave = {"wave": w, "s": {k: round(v, 4) for k, v in med.items()},
                "ratios": {k: round(v, 3) for k, v in ratios.items()}}
        waves.append(wave)
        print(json.dumps(wave), flush=True)
    summary = {}
    for key in waves[0]["ratios"]:
        vals = [w["ratios"][key] for w in waves]
        summary[key] = {"median": round(statistics.median(vals), 3), "min": min(vals),
                        "max": max(vals), "waves": vals}
    for key in names:
        vals = [w["s"][key] for w in waves]
        summary[key + "_s"] = {"median": round(statistics.median(vals), 4), "min": min(vals),
                               "max": max(vals)}
    out = {"shape": args.shape, "rows": args.rows, "tokens": args.tokens, "micro": micro,
           "gpu": gpu, "peak_gib": peak, "summary": summary,
           "waves": waves}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    print("| variant | median ratio | min-max |")
    for key, v in summary.items():
        if "/" in key or "throughput" in key:
            print(f"| {key} | {v['median']:.2f} | {v['min']:.2f}-{v['max']:.2f} |")
    print(json.dumps({"shape": args.shape, "done_s": round(time.perf_counter() - t0, 1)}))


if __name__ == "__main__":
    main()
