#!/usr/bin/env bash
# On the GPU machine, call 3 of fetch_tasks_kit.sh (carry [".gguf2", ".gpu-snap"]): join SmolLM2's
# GGUF and run the task catalog's learning benchmark, the seeds in parallel (one process each, one
# GPU). TASK, SEEDS, STEPS, EVAL_EVERY, EVAL_N, EXTRA (more task_learning.py arguments) override.
set -euo pipefail
test -f /tmp/gguf/part00 || { echo "call 2 did not run on this machine (cold start?)"; exit 3; }
test -d /tmp/site/langgraph || { echo "call 1 did not run on this machine (cold start?)"; exit 3; }
cat /tmp/gguf/part00 .gguf2/part01 > /tmp/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
cd .gpu-snap
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
  TRACERL_SMOLLM2_GGUF_DIR=/tmp/gguf TRACERL_CACHE=/tmp/cache TRACERL_QUIET=1 TRACERL_DISABLE_UNSLOTH=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
python3 -m tracerl prepare-model smollm2 > /dev/null
timeout "${RUN_TIMEOUT_S:-500}" python3 benchmarks/task_learning.py --task "${TASK:-tool-products}" \
  --seeds ${SEEDS:-0 1 2} --steps "${STEPS:-20}" --eval-every "${EVAL_EVERY:-5}" \
  --eval-n "${EVAL_N:-32}" --parallel --path /tmp/tl --out "$OUT/task-learning.json" ${EXTRA:-} \
  2> "$OUT/task-learning.err" | tee "$OUT/task-learning.md" || { tail -40 "$OUT/task-learning.err"; exit 1; }
for h in /tmp/tl/*/models/*/history.jsonl; do cp "$h" "$OUT/$(basename "$(dirname "$h")").history.jsonl"; done
