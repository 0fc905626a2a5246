#!/usr/bin/env bash
# Download, here, vLLM 0.26.0 (the release built for the device's torch 2.11 / CUDA 13) and what
# its OpenAI server imports, in two folders that each fit one device call (64 MiB):
#   .vllm1/   the first part of a slim vLLM tarball (xz)
#   .vllm2/   the rest of it, the ~50 wheels vLLM's server imports that the device lacks,
#             tracerl's own wheel, and SmolLM2's tokenizer (tok/) for random-initialised models
# Slim = the wheel without what a dense bf16 model on an H100/H200 never loads: the sm80
# FlashAttention-2 kernels (Hopper runs FA3), the fused-MoE extension (imported optionally), the
# Rust frontend binary, and the DeepGEMM / sm100 FMHA sources. 304 MB wheel -> 74 MB tar.xz.
# Left out on purpose: flashinfer, tilelang, cutlass-dsl and the other kernel libraries: vLLM
# falls back to FA3 attention and PyTorch sampling without them.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
for d in .vllm1 .vllm2; do
  grep -qx "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >> .git/info/exclude
done
CACHE=${TRACERL_KIT_CACHE:-$HOME/.cache/tracerl-gpu-kit}
mkdir -p "$CACHE"
P=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
   --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64
   --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
   --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64
   --platform any)
WHEEL=$CACHE/vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl
[ -f "$WHEEL" ] || python3 -m pip download -q "${P[@]}" -d "$CACHE" vllm==0.26.0
rm -rf .vllm1 .vllm2 "$CACHE/unpacked" && mkdir -p .vllm1 .vllm2/tok "$CACHE/unpacked"
(cd "$CACHE/unpacked" && python3 -m zipfile -e "$WHEEL" . &&
 tar -cf - --exclude=vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so \
   --exclude=vllm/_moe_C_stable_libtorch.abi3.so --exclude=vllm/vllm-rs \
   --exclude=vllm/third_party/deep_gemm --exclude=vllm/third_party/fmha_sm100 \
   --exclude=__pycache__ vllm vllm-0.26.0.dist-info | xz -T0 -6 > "$CACHE/vllm-slim.tar.xz")
rm -rf "$CACHE/unpacked"
head -c 58M "$CACHE/vllm-slim.tar.xz" > .vllm1/part00
tail -c +$((58 * 1024 * 1024 + 1)) "$CACHE/vllm-slim.tar.xz" > .vllm2/part01
# What vLLM 0.26's server and GPU worker import at module level, minus what the device has
# (found by importing its serving path with a recording import hook, benchmarks/gpu/README.md).
python3 -m pip download -q "${P[@]}" -d .vllm2 blake3 cachetools cbor2 ijson pybase64 \
  setproctitle msgspec pyzmq watchfiles python-json-logger partial-json-parser \
  'fastapi>=0.133,<0.137' 'starlette>=1.0.1' uvicorn python-multipart httptools \
  pydantic==2.14.4 pydantic_core==2.50.5 annotated-types typing-inspection pydantic-settings \
  pydantic-extra-types pycountry python-dotenv openai==3.57.0 jiter distro sniffio httpx2 \
  httpcore2 truststore prometheus-fastapi-instrumentator 'lm-format-enforcer==0.11.3' interegular \
  'llguidance>=1.7,<1.8' outlines_core==0.2.14 lark==1.2.2 'xgrammar>=0.2.1,<1' \
  'apache-tvm-ffi>=0.1.11' jsonschema jsonschema-specifications referencing rpds-py \
  'mistral_common>=1.11.5' compressed-tensors==0.17.0 loguru depyf==0.20.0 astor dill \
  openai-harmony 'model-hosting-container-standards>=0.1.14,<1' jmespath supervisor diskcache \
  orjson  # tracerl's engine replies (the device has aiohttp)
.venv/bin/pip wheel -q --no-deps --no-build-isolation -w .vllm2 . && rm -rf build
TOK=$(.venv/bin/tracerl prepare-model smollm2)
cp "$TOK"/tokenizer.json "$TOK"/tokenizer_config.json "$TOK"/chat_template.jinja .vllm2/tok/
du -sh .vllm1 .vllm2   # each must stay under the 64 MiB a device call carries
