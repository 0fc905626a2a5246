#!/usr/bin/env bash
# On the GPU machine, call 3 of fetch_tasks_kit.sh (carry [".gguf2", ".gpu-snap"]): join SmolLM2's
# GGUF and run the task catalog's learning benchmark, the seeds in parallel (one process each, one
# GPU). TASK (or TASKS: several tasks side by side), SEEDS, STEPS, EVAL_EVERY, EVAL_N, EXTRA (more
# task_learning.py arguments) override. PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True by
# default: ten processes on one card ran out of memory on 2026-12-07 (4-15 GiB each).
set -euo pipefail
test -f /tmp/gguf/part00 || { echo "call 2 did not run on this machine (cold start?)"; exit 3; }
test -d /tmp/site/langgraph || { echo "call 1 did not run on this machine (cold start?)"; exit 3; }
test -f /tmp/gguf/SmolLM2-135M-Instruct.Q4_1.gguf ||
  cat /tmp/gguf/part00 .gguf2/part01 > /tmp/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
# node-chain-sum's Node.js, from the kit's call 2b (install_node.sh), when it ran
if [ -x /tmp/bin/node ]; then export PATH=/tmp/bin:$PATH TRACERL_NPM_PREFIX=/tmp/npm; fi
case " ${TASKS:-${TASK:-}} " in *" node-chain-sum "*)
  command -v node > /dev/null || { echo "node-chain-sum needs Node.js: run the kit's call 2b (install_node.sh) first"; exit 3; };;
esac
cd .gpu-snap
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
  TRACERL_SMOLLM2_GGUF_DIR=/tmp/gguf TRACERL_CACHE=/tmp/cache TRACERL_QUIET=1 TRACERL_DISABLE_UNSLOTH=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
python3 -m tracerl prepare-model smollm2 > /dev/null
# one run, or two side by side (EXTRA_B: the second's arguments, e.g. an A/B of settings); each
# seed's points so far are written after each evaluation (task-learning*.json.seedN.json), and
# the histories come back also when the run is cut short
learn() {  # $1: name, $2: extra arguments, $3: the task (default: TASK)
  timeout "${RUN_TIMEOUT_S:-500}" python3 benchmarks/task_learning.py --task "${3:-${TASK:-tool-products}}" \
    --seeds ${SEEDS:-0 1 2} --steps "${STEPS:-20}" --eval-every "${EVAL_EVERY:-5}" \
    --eval-n "${EVAL_N:-32}" --parallel --path "/tmp/tl-$1" --tag "$1" --out "$RES/$1.json" $2 \
    2> "$RES/$1.err" > "$RES/$1.md" || { echo "run $1 failed or was cut short"; tail -20 "$RES/$1.err"; }
}
# The runs start in a process session of their own (setsid), which outlives this call while the
# machine stays warm: a run longer than one call's 10 minutes is started by the first call and
# collected by the next ones (the same command: it starts nothing when runs are under way).
# WAIT_S: how long this call waits for the runs to end before it brings back what they have.
RES=/tmp/res
if [ ! -f $RES/started ]; then
  rm -rf $RES; mkdir -p $RES; touch $RES/started
  export -f learn; export RES
  # TASKS="a b ...": one run per task side by side, on the same settings (EXTRA)
  setsid bash -c 'if [ -n "${TASKS:-}" ]; then for t in $TASKS; do learn "$t" "${EXTRA:-}" "$t" & done
    else learn task-learning "${EXTRA:-}" & fi
    if [ -n "${EXTRA_B:-}" ]; then learn task-learning-b "$EXTRA_B" & fi
    wait; touch $RES/done' > $RES/runs.log 2>&1 < /dev/null &
fi
deadline=$((SECONDS + ${WAIT_S:-540}))
while [ ! -f $RES/done ] && [ $SECONDS -lt $deadline ]; do sleep 5; done
test -f $RES/done && echo "runs ended" || echo "runs still going after ${WAIT_S:-540} s: call again"
cat $RES/*.md $RES/runs.log 2>/dev/null || true
for f in $RES/*.seed*.json; do test -f "$f" && echo "$(basename "$f"): $(head -c 300 "$f")"; done
for h in /tmp/tl-*/*/models/*/history.jsonl; do
  test -f "$h" && cp "$h" "$RES/$(basename "$(dirname "$h")").history.jsonl"
done
# at most 8 files come back from $OUT: the tables and logs, and everything in one archive
cp $RES/*.md "$OUT/" 2>/dev/null || true  # the logs are in the archive
tar czf "$OUT/runs.tgz" -C $RES .
