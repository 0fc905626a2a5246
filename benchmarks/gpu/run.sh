#!/usr/bin/env bash
# On the GPU machine, the training-step row (carry [".whl"], filled by fetch_kit.sh): install the
# carried wheels into /tmp/tsite (its own folder: vLLM's kit pins other FastAPI/Starlette versions
# into /tmp/site), put the first part of the vLLM tarball, if carried, in /tmp/vk for the vLLM
# calls that follow, then for each SHAPE:BATCH run benchmarks/gpu/train_waves.py: tracerl's step
# on Unsloth in one process, tracerl's step on peft and TRL's GRPO loss step in another, taking
# turns on the GPU wave by wave (Unsloth replaces TRL's trainer in its own process).
#   bash benchmarks/gpu/run.sh [qwen2.5-0.5b:32 qwen2.5-1.5b:32 ...]
# env: WAVES (default 5), REPEATS (steps per side and wave, default 5), PARITY=1 (also the
# Unsloth/peft parity check of one step, benchmarks/gpu/unsloth_parity.py)
set -euo pipefail
KIT=${KIT:-.whl}
mkdir -p /tmp/tsite /tmp/vk
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/tsite "$KIT"/*.whl
echo "installed $(ls "$KIT"/*.whl | wc -l) wheels from $KIT"
cp "$KIT"/part* /tmp/vk/ 2>/dev/null || true
export PYTHONPATH=$PWD:$PWD/benchmarks:/tmp/tsite PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 \
  TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/trainlogs
nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,clocks.max.sm --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
for cfg in ${@:-qwen2.5-0.5b:32 qwen2.5-1.5b:32}; do
  shape=${cfg%%:*} batch=${cfg##*:}
  echo "$(date +%T) $shape b$batch"
  timeout ${TRAIN_TIMEOUT_S:-280} python3 benchmarks/gpu/train_waves.py --shape "$shape" \
    --batch "$batch" --tokenizer "$KIT/tok" --waves ${WAVES:-5} --repeats ${REPEATS:-5} \
    --logs /tmp/trainlogs --json "$OUT/train-$shape-b$batch.json" \
    > "/tmp/trainlogs/$shape-b$batch.out" 2>&1 \
    || { echo "FAILED $cfg"; tail -30 "/tmp/trainlogs/$shape-b$batch.out";
         tail -30 /tmp/trainlogs/$shape-b$batch-*.log; }
  grep -E '^\{"(shape|wave)' "/tmp/trainlogs/$shape-b$batch.out" | tail -1 || true
  grep -hE '^\{"wave"' /tmp/trainlogs/$shape-b$batch-*.log || true
done
if [ "${PARITY:-0}" = 1 ]; then
  TRACERL_DISABLE_UNSLOTH=0 timeout 300 python3 benchmarks/gpu/unsloth_parity.py --tokenizer "$KIT/tok" \
    --batch 8 --length 512 --json "$OUT/unsloth_parity.json" 2>&1 | tail -16
fi
tar czf "$OUT/train-logs.tgz" -C /tmp trainlogs
