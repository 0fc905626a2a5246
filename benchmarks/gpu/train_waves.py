"""tracerl's training step with Unsloth versus TRL's GRPO loss step, alternating wave by wave.

Unsloth replaces TRL's ``GRPOTrainer`` when imported, so TRL's step cannot be timed in the
process that holds tracerl's Unsloth trainer. This starts two processes of
``benchmarks/train_step_vs_trl.py`` on one GPU, on the same random-initialised model folder and
batch: one with tracerl's trainer on Unsloth (``--no-trl``), one with plain peft
(``TRACERL_DISABLE_UNSLOTH=1``) that times tracerl's peft step and TRL's step in turn. They take
turns (warm-up, then ``--waves`` waves of ``--repeats`` steps per side), each emptying its
allocator cache before handing the GPU over, and each wave's ratio compares adjacent waves.

    python benchmarks/gpu/train_waves.py --shape qwen2.5-1.5b --batch 32 --tokenizer TOK \\
        --waves 5 --repeats 5 --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCH = HERE.parent / "train_step_vs_trl.py"


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "values": values}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", required=True)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--completion", type=int, default=256)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--waves", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=400)
    ap.add_argument("--json")
    ap.add_argument("--logs", default=tempfile.gettempdir())
    args = ap.parse_args()

    sys.path.insert(0, str(HERE.parent))
    from random_models import random_model_dir

    Path(args.logs).mkdir(parents=True, exist_ok=True)
    model = random_model_dir(args.shape, Path(args.tokenizer))  # one folder for both sides
    turns = tempfile.mkdtemp(prefix="turns-")
    common = [sys.executable, str(BENCH), "--model", str(model), "--batch", str(args.batch),
              "--prompt", str(args.prompt), "--completion", str(args.completion),
              "--repeats", str(args.repeats), "--waves", str(args.waves),
              "--turn-dir", turns, "--turn-roles", "2"]
    sides = {"unsloth": (["--turn-role", "0", "--no-trl"], "0"),
             "peft": (["--turn-role", "1"], "1")}
    procs, outs = {}, {}
    for name, (extra, disable) in sides.items():
        outs[name] = Path(args.logs) / f"{args.shape}-b{args.batch}-{name}.json"
        log = open(Path(args.logs) / f"{args.shape}-b{args.batch}-{name}.log", "w")
        procs[name] = subprocess.Popen(common + extra + ["--json", str(outs[name])],
                                       env={**os.environ, "TRACERL_DISABLE_UNSLOTH": disable},
                                       stdout=log, stderr=subprocess.STDOUT)
    failed = []
    for name, proc in procs.items():
        try:
            if proc.wait(timeout=args.timeout) != 0:
                failed.append(name)
        except subprocess.TimeoutExpired:
            failed.append(name)
        if failed:  # the other one would wait for its turn until its own deadline
            for other in procs.values():
                if other.poll() is None:
                    other.kill()
                    other.wait()
    if failed:
        print(json.dumps({"shape": args.shape, "failed": failed}))
        sys.exit(1)
    u = json.loads(outs["unsloth"].read_text())
    p = json.loads(outs["peft"].read_text())
    if u["trainer_backend"] != "unsloth":
        print(f"warning: the Unsloth side ran {u['trainer_backend']}", file=sys.stderr)
    uw, pw, tw = (u["tracerl_waves_tokens_per_s"], p["tracerl_waves_tokens_per_s"],
                  p["trl_waves_tokens_per_s"])
    result = {
        "shape": args.shape, "batch": args.batch, "tokens_per_step": u["tokens_per_step"],
        "waves": args.waves, "steps_per_wave_and_side": args.repeats,
        "unsloth_backend": u["trainer_backend"],
        "tracerl_unsloth_tokens_per_s": spread(uw),
        "tracerl_peft_tokens_per_s": spread(pw),
        "trl_tokens_per_s": spread(tw),
        # wave i of the Unsloth process ran just before wave i of the peft/TRL process
        "ratio_unsloth_over_trl_per_wave": spread([a / b for a, b in zip(uw, tw, strict=True)]),
        "ratio_peft_over_trl_per_wave": spread([a / b for a, b in zip(pw, tw, strict=True)]),
        "matmul_tflops_measured": [u["matmul_tflops_measured"], p["matmul_tflops_measured"]],
        "params": u["params"], "params_matmul": u["params_matmul"],
        "mfu_matmul_measured": {"unsloth": u["tracerl_mfu_matmul"],
                                "peft": p["tracerl_mfu_matmul"], "trl": p["trl_mfu_matmul"]},
        "mfu_matmul_spec989": {"unsloth": u["tracerl_mfu_matmul_spec"],
                               "peft": p["tracerl_mfu_matmul_spec"],
                               "trl": p["trl_mfu_matmul_spec"]},
        "mfu_allparams_measured": {"unsloth": u["tracerl_mfu"], "peft": p["tracerl_mfu"],
                                   "trl": p["trl_mfu"]},
        "peak_memory_gib": {"unsloth": u.get("peak_memory_gib"),
                            "peft_and_trl": p.get("peak_memory_gib")},
        "device": p["device"],
    }
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
