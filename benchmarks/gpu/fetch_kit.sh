#!/usr/bin/env bash
# Download, here, the training kit and the vLLM kit in three folders of at most ~58 MiB each,
# one per device call (64 MiB a call, the working tree included), issued back to back:
#   .whl/    the training wheels (fetch_wheels.sh's .whl and .whl2, with bitsandbytes cut to its
#            CUDA 13 and CPU libraries: 43 -> 7 MB), tracerl's wheel, SmolLM2's tokenizer (tok/),
#            and part00, the head of vLLM's slim tarball        -> bash benchmarks/gpu/run.sh
#   .vllm1/  part01, the tarball's middle                       -> cp .vllm1/part* /tmp/vk/
#   .vllm2/  part02, vLLM's imports, tracerl's wheel, tok/      -> bash benchmarks/gpu/vllm_run.sh
# (fetch_wheels.sh makes the older four-call training layout, with the demo's GGUF.) The GGUF demo is left out.
#   DEST=/path/to/checkout bash benchmarks/gpu/fetch_kit.sh   (default: this checkout)
set -euo pipefail
SRC=$(cd "$(dirname "$0")/../.." && pwd)
DEST=${DEST:-$SRC}
PY=${PY:-$SRC/.venv/bin/python}
CACHE=${TRACERL_KIT_CACHE:-$HOME/.cache/tracerl-gpu-kit}
LIMIT=$((58 * 1024 * 1024))
mkdir -p "$CACHE"
cd "$DEST"
rm -rf .whl .whl2 .vllm1 .vllm2 && mkdir -p .whl/tok .vllm1 .vllm2/tok
P=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
   --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64
   --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
   --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64
   --platform any)
python3 -m pip download -q "${P[@]}" -d .whl pydantic==2.14.4 pydantic_core==2.50.5 annotated-types \
  typing-inspection openai==3.57.0 httpx2 httpcore2 jiter distro sniffio trl==1.15.0 'datasets<5,!=4.4.*,!=4.5.0' dill \
  multiprocess unsloth==2026.10.9 unsloth_zoo==2026.10.9 torchao==0.18.0 cut_cross_entropy==25.1.1 \
  tyro docstring-parser typeguard shtab msgspec fastapi starlette annotated-doc uvicorn gguf \
  opentelemetry-api importlib_metadata truststore lazy-importer eval-type-backport json5 structlog \
  nest-asyncio
# bitsandbytes (Unsloth imports it): only the libraries a CUDA 13 torch and the CPU load
BNB=$CACHE/bnb && rm -rf "$BNB" && mkdir -p "$BNB"
python3 -m pip download -q "${P[@]}" -d "$CACHE" bitsandbytes==0.50.2
(cd "$BNB" && python3 -m zipfile -e "$CACHE"/bitsandbytes-0.50.2-*.whl . &&
 find bitsandbytes -name 'libbitsandbytes_*.so' ! -name '*cuda130*' ! -name '*cuda132*' ! -name '*_cpu*' -delete &&
 python3 - "$DEST/.whl" <<'PY'
import base64, hashlib, os, sys, zipfile
files = sorted(os.path.join(r, f)[2:] for r, _, fs in os.walk(".") for f in fs)
record = next(f for f in files if f.endswith(".dist-info/RECORD"))
lines = []
for f in files:
    if f != record:
        data = open(f, "rb").read()
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        lines.append(f"{f},sha256={digest},{len(data)}")
open(record, "w").write("\n".join(lines + [f"{record},,"]) + "\n")
with zipfile.ZipFile(f"{sys.argv[1]}/bitsandbytes-0.50.2-py3-none-manylinux_2_24_x86_64.whl", "w",
                     zipfile.ZIP_DEFLATED) as z:
    for f in files:
        z.write(f, f)
PY
)
rm -rf "$BNB"
python3 -m pip download -q "${P[@]}" -d .vllm2 -r "$SRC/benchmarks/gpu/vllm_deps.txt"
(cd "$SRC" && "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$DEST/.whl" . && rm -rf build)
cp .whl/tracerl-*.whl .vllm2/
TOK=$(cd "$SRC" && PYTHONPATH=$SRC "$PY" -c "import sys; from tracerl.cli import main; sys.argv = ['tracerl', 'prepare-model', 'smollm2']; main()")
for d in .whl/tok .vllm2/tok; do
  cp "$TOK"/tokenizer.json "$TOK"/tokenizer_config.json "$TOK"/chat_template.jinja "$d"/
done
# vLLM 0.26.0's slim tarball (benchmarks/gpu/README.md says what is left out), cut to fill the three folders
WHEEL=$CACHE/vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl
[ -f "$WHEEL" ] || python3 -m pip download -q "${P[@]}" -d "$CACHE" vllm==0.26.0
if [ ! -f "$CACHE/vllm-slim.tar.xz" ]; then
  rm -rf "$CACHE/unpacked" && mkdir -p "$CACHE/unpacked"
  (cd "$CACHE/unpacked" && python3 -m zipfile -e "$WHEEL" . &&
   tar -cf - --exclude=vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so \
     --exclude=vllm/_moe_C_stable_libtorch.abi3.so --exclude=vllm/vllm-rs \
     --exclude=vllm/third_party/deep_gemm --exclude=vllm/third_party/fmha_sm100 \
     --exclude=__pycache__ vllm vllm-0.26.0.dist-info | xz -T0 -6 > "$CACHE/vllm-slim.tar.xz")
  rm -rf "$CACHE/unpacked"
fi
TAR=$CACHE/vllm-slim.tar.xz
HEAD=$((LIMIT - $(du -sb .whl | cut -f1)))
MID=$LIMIT
python3 - "$TAR" $HEAD $MID <<'PY'
import sys
data = open(sys.argv[1], "rb").read()
head, mid = int(sys.argv[2]), int(sys.argv[3])
for name, part in ((".whl/part00", data[:head]), (".vllm1/part01", data[head:head + mid]),
                   (".vllm2/part02", data[head + mid:])):
    open(name, "wb").write(part)
PY
cat .whl/part00 .vllm1/part01 .vllm2/part02 | cmp - "$TAR"
du -sb .whl .vllm1 .vllm2   # each must stay under 64 MiB minus the working tree
[ "$(du -sb .vllm2 | cut -f1)" -le "$LIMIT" ] || { echo ".vllm2 is over $LIMIT bytes"; exit 1; }
