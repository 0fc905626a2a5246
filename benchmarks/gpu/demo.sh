#!/usr/bin/env bash
# On the GPU machine, device call 4 (carry [".gguf2"]; call 3 copied .gguf1/part00 to /tmp/gguf):
# join SmolLM2's GGUF, then run `tracerl demo` (12 steps, the README's task) on the GPU twice,
# with Unsloth and with plain peft; histories and logs go to $OUT.
set -euo pipefail
test -f /tmp/gguf/part00 || { echo "call 3 did not run on this machine (cold start?)"; exit 3; }
cat /tmp/gguf/part00 .gguf2/part01 > /tmp/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
  TRACERL_SMOLLM2_GGUF_DIR=/tmp/gguf TRACERL_CACHE=/tmp/cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for backend in unsloth peft; do
  rm -rf "/tmp/demo-$backend"
  TRACERL_DISABLE_UNSLOTH=$([ "$backend" = peft ] && echo 1 || echo 0) timeout 280 \
    python3 -m tracerl demo --steps 12 --base-path "/tmp/demo-$backend" > "$OUT/demo-$backend.log" 2>&1 || true
  tail -8 "$OUT/demo-$backend.log"
  cp /tmp/demo-"$backend"/*/models/*/history.jsonl "$OUT/history-$backend.jsonl" || true
done
