#!/usr/bin/env bash
# On the GPU machine, device call 2 (carry [".whl2"], after call 1 installed .whl):
# the training-step benchmark for each SHAPE:BATCH, with Unsloth (tracerl's trainer picks it when
# importable on CUDA) and with plain peft (TRACERL_DISABLE_UNSLOTH=1), each against TRL's loss
# step in its process; then the Unsloth-versus-peft parity check of one step.
#   bash benchmarks/gpu/run.sh [qwen2.5-0.5b:32 qwen2.5-1.5b:32 ...]
set -euo pipefail
bash benchmarks/gpu/install.sh .whl2
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
KEYS='"(model|batch|trainer_backend|tracerl_tokens_per_s|trl_tokens_per_s|ratio_tracerl_over_trl|tracerl_mfu|trl_mfu|peak_memory_gib|trl_error)"|Error'
for cfg in ${@:-qwen2.5-0.5b:32 qwen2.5-1.5b:32}; do
  shape=${cfg%%:*} batch=${cfg##*:}
  for backend in unsloth peft; do
    TRACERL_DISABLE_UNSLOTH=$([ "$backend" = peft ] && echo 1 || echo 0) timeout 280 \
      python3 benchmarks/train_step_vs_trl.py --random-init "$shape" --tokenizer .whl2/tok \
      --batch "$batch" --prompt 256 --completion 256 --repeats 3 --json "$OUT/$shape-b$batch-$backend.json" \
      > "$OUT/$shape-b$batch-$backend.log" 2>&1 || true
    grep -E "$KEYS" "$OUT/$shape-b$batch-$backend.log" | tail -12
  done
done
timeout 300 python3 benchmarks/gpu/unsloth_parity.py --tokenizer .whl2/tok --batch 8 --length 512 \
  --json "$OUT/unsloth_parity.json" 2>&1 | tail -16
