#!/usr/bin/env bash
# Download, here, the wheels the GPU machine lacks (cp312, manylinux x86_64) into .whl/ at the
# repository root, plus SmolLM2's tokenizer for random-initialised models. The device has torch
# 2.11, transformers 5.17, peft 0.21, accelerate, pyarrow, pandas; it lacks pydantic, openai
# (httpx2...), TRL and datasets. --no-deps: only what the imports need (a full resolution
# against the device's packages conflicts).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
mkdir -p .whl/tok
P=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
   --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
   --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d .whl)
python3 -m pip download -q "${P[@]}" pydantic==2.14.4 pydantic_core==2.50.5 annotated-types \
  typing-inspection openai==3.57.0 httpx2 httpcore2 jiter distro sniffio trl==1.16.0 datasets dill multiprocess
TOK=$(.venv/bin/tracerl prepare-model smollm2)
cp "$TOK"/tokenizer.json "$TOK"/tokenizer_config.json "$TOK"/chat_template.jinja .whl/tok/
du -sh .whl   # must stay under the 64 MiB a device call carries
