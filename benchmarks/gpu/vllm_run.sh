#!/usr/bin/env bash
# On the GPU machine, the last call of the vLLM kit (carry [".vllm2"]; the calls before copied
# the tarball's first parts to /tmp/vk: .vllm1/part*, and .whl/part00 with fetch_kit.sh's
# layout, copied by run.sh or carried here as .whl/part00): install vLLM and its imports into
# /tmp/site, then run benchmarks/rollout_throughput.py (gateway vs vLLM alone) on
# random-initialised models.
#   bash benchmarks/gpu/vllm_run.sh [smollm2-135m:16,64,256 qwen2.5-0.5b:64,256 loop loop-7b
#                                    adapter-smollm2-135m:64,256 async-qwen2.5-1.5b]
# env: WAVES (default 3), PROFILE=1 (py-spy: the gateway process / vLLM's engine core),
#      VLLM_ARGS (extra benchmark flags, e.g. "--vllm-arg=--max-loras=1"),
#      ASYNC_STEPS (timed steps a side, default 2), ASYNC_REPEATS (default 1; 2: sync, async,
#      async, sync), ASYNC_ADAPTER_STEPS_ONLY (default 1: the first bound + 1 = 3 steps of each
#      side run untimed, so that both sides' timed steps sample through adapters; 0: time all),
#      REPLICAS=K (rollout jobs: the gateway over K servers on the GPU vs one of them directly),
#      GATEWAY_VARIANTS="url uvloop httptools groupfsync" (rollout jobs: more gateways in the
#      same waves, rollout_throughput.py's docstring)
set -euo pipefail
# part00 travels in .whl: a call that did not follow run.sh carries [".vllm2", ".whl/part00"]
[ -f .whl/part00 ] && mkdir -p /tmp/vk && cp .whl/part00 /tmp/vk/
for part in part00 part01; do
  [ -f /tmp/vk/$part ] || { echo "/tmp/vk/$part is missing (cold start? carry .whl/part00, and run the .vllm1 call just before)"; exit 3; }
done
mkdir -p /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .vllm2/*.whl
cat /tmp/vk/part* .vllm2/part* | python3 -c \
  "import sys, tarfile; tarfile.open(fileobj=sys.stdin.buffer, mode='r|xz').extractall('/tmp/site', filter='fully_trusted')"
# vLLM runs in its own process; tracerl's engine drops PYTHONPATH for it, so point
# TRACERL_VLLM_PYTHON at an interpreter that brings /tmp/site along.
printf '#!/bin/sh\nexport PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0\nexec python3 "$@"\n' > /tmp/vllm-python
chmod +x /tmp/vllm-python
export PATH=/tmp/site/bin:$PATH PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
  TRACERL_VLLM_PYTHON=/tmp/vllm-python TRACERL_CACHE=/tmp/cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
/tmp/vllm-python -c "import vllm, torch, vllm.entrypoints.openai.api_server; print('vllm', vllm.__version__, torch.cuda.get_device_name(0))" || true
run_rollouts() {  # SHAPE:C1,C2...
  local shape=${1%%:*} conc=${1##*:}
  timeout ${ROLLOUT_TIMEOUT_S:-280} python3 benchmarks/rollout_throughput.py --random-init "$shape" --tokenizer .vllm2/tok \
    --concurrency ${conc//,/ } --max-tokens 256 --waves ${WAVES:-3} --json "$OUT/rollout-$shape.json" \
    ${PROFILE:+--profile "$OUT"} --replicas ${REPLICAS:-1} ${VLLM_ARGS:-} \
    ${GATEWAY_VARIANTS:+--gateway-variants $GATEWAY_VARIANTS} \
    > "$OUT/rollout-$shape.log" 2>&1 || { echo "FAILED $shape"; tail -40 "$OUT/rollout-$shape.log"; }
  grep -E '^\{"concurrency"' "$OUT/rollout-$shape.log" || true
}
adapter_check() {  # adapter-SHAPE:C1,C2: LoRA-served vs base tokens/s on one server
  local spec=${1#adapter-}
  local shape=${spec%%:*} conc=${spec##*:}
  timeout ${ROLLOUT_TIMEOUT_S:-300} python3 benchmarks/adapter_serving.py --random-init "$shape" \
    --tokenizer .vllm2/tok --concurrency ${conc//,/ } --max-tokens 256 --waves ${WAVES:-3} \
    ${PROFILE:+--profile} ${VLLM_ARGS:-} --json "$OUT/adapter-$shape.json" \
    > "$OUT/adapter-$shape.log" 2>&1 || { echo "FAILED $1"; tail -40 "$OUT/adapter-$shape.log"; }
  grep -E '^\{"concurrency"' "$OUT/adapter-$shape.log" || true
}
loop_check() {  # the whole loop: rollouts, a GRPO step with vLLM asleep, the adapter hot-loaded
  # loop = SmolLM2-135M shape; loop-7b = Qwen2.5-7B shape with vLLM at 75% of the GPU, which
  # checks that the trainer's own copy of the weights fits beside the sleeping engine
  local args=() name=vllm-loop
  [ "${1%-r*}" = loop-7b ] && { args=(--shape qwen2.5-7b --gpu-memory-utilization 0.75); name=vllm-loop-7b; }
  case $1 in *-r[0-9]*) args+=(--replicas-per-gpu "${1##*-r}"); name=$name-r${1##*-r} ;; esac
  (while sleep 10; do nvidia-smi --query-gpu=memory.used --format=csv,noheader; done > "$OUT/$name-smi.log") &
  local smi=$!
  timeout 540 python3 benchmarks/gpu/vllm_loop.py --tokenizer .vllm2/tok --steps 2 "${args[@]}" \
    --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1 || echo "FAILED $1"
  kill $smi
  grep -E '^\{"(step|served)' "$OUT/$name.log" || tail -30 "$OUT/$name.log"
}
async_check() {  # async-SHAPE: the async pipeline (bound 2) vs the sync loop, steps per minute,
  # vLLM serving while the trainer trains on the same GPU; rollouts of 64/256/1024 tokens.
  # ASYNC_STEPS (default 2) timed steps after 3 untimed ones (ASYNC_ADAPTER_STEPS_ONLY=1, the
  # default: async's first bound + 1 steps sample from the base model, which vLLM serves ~10x
  # faster than through LoRA, HISTORY.md 2026-12-06); 4 steps in all did not fit one call beside
  # two ~200 s vLLM starts (session 12); each side's result is in the log as soon as it ends,
  # with base_calls_timed (0: every timed call went through an adapter) and, for async,
  # cancelled_groups (its run-ahead rollouts cancelled when it ended, in vLLM too)
  # ASYNC_REPEATS=2 runs sync, async, async, sync (the order alternates each repeat), so a side
  # that pays the first use of the server or the trainer is seen; GPU use and the busiest
  # processes are sampled every 5 s beside it ($OUT/$1-smi.log, $1-top.log)
  local shape=${1#async-}
  (while sleep 5; do echo "$(date +%T) $(nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader)"; done > "$OUT/$1-smi.log") &
  local smi=$!
  (while sleep 5; do date +%T; top -b -n 1 -o %CPU 2>&1 | sed -n 7,14p; done > "$OUT/$1-top.log") &
  local top=$!
  timeout ${ROLLOUT_TIMEOUT_S:-560} python3 benchmarks/async_vs_sync.py --engine vllm \
    --random-init "$shape" --tokenizer .vllm2/tok --gpu-memory-utilization 0.5 --steps ${ASYNC_STEPS:-2} \
    --groups 4 --group-size 8 --bound 2 --lengths 64 256 1024 --env-s 0 1 --repeats ${ASYNC_REPEATS:-1} \
    $([ "${ASYNC_ADAPTER_STEPS_ONLY:-1}" = 1 ] && echo --adapter-steps-only) \
    > "$OUT/$1.json" 2> "$OUT/$1.log" || { echo "FAILED $1"; tail -40 "$OUT/$1.log"; }
  kill $smi $top 2>/dev/null || true
  grep -E '^\{"side"' "$OUT/$1.log" || true
  cat "$OUT/$1.json"
}
[ "${1%-r*}" = loop-7b ] || python3 benchmarks/call_record_write.py | tee "$OUT/call_record_write.json"  # the disk's fsync cost
# each vLLM start on the H200 takes ~100 s (compile, CUDA graphs); a call has 600 s
for job in ${@:-smollm2-135m:16,64,256 qwen2.5-0.5b:64,256}; do
  echo "$(date +%T) $job"
  case $job in loop|loop-7b|loop-r*|loop-7b-r*) loop_check "$job" ;; adapter-*) adapter_check "$job" ;;
    async-*) async_check "$job" ;;
    *) run_rollouts "$job" ;; esac
done
cp /tmp/tracerl-vllm-*.log "$OUT/" 2>/dev/null || true
