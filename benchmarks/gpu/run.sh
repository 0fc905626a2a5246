#!/usr/bin/env bash
# On the GPU machine: install the carried wheels first on PYTHONPATH, then run the benchmarks.
# Called through the device tool with carry [".whl"]:  bash benchmarks/gpu/run.sh
set -euo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for cfg in "qwen2.5-0.5b 8" "qwen2.5-0.5b 32" "qwen2.5-1.5b 32" "qwen2.5-7b 8"; do
  set -- $cfg
  timeout 280 python3 benchmarks/train_step_vs_trl.py --random-init "$1" --tokenizer .whl/tok \
    --batch "$2" --prompt 256 --completion 256 --repeats 3 --json "$OUT/$1-b$2.json" 2>&1 \
    | grep -E '"(model|batch|tracerl_tokens_per_s|trl_tokens_per_s|ratio_tracerl_over_trl|tracerl_mfu|trl_mfu|peak_memory_gib|tracerl_tensor_build_ms|ratio_without_tensor_build|trainer_backend)"|Error'
done
