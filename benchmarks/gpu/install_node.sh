#!/usr/bin/env bash
# On the GPU machine, the kit's call 2b (carry [".node"]): Node.js and the openai npm package
# for the node-chain-sum task, into /tmp/bin and /tmp/npm, which tasks_run.sh puts on PATH and in
# TRACERL_NPM_PREFIX. python3's lzma unpacks the binary (the device may lack xz).
set -euo pipefail
KIT=${1:-.node}
mkdir -p /tmp/bin /tmp/npm
python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'))" \
  "$KIT/node.xz" /tmp/bin/node
chmod +x /tmp/bin/node
tar xzf "$KIT/npm.tgz" -C /tmp/npm
/tmp/bin/node --version
test -f /tmp/npm/node_modules/openai/package.json && echo "openai npm package in /tmp/npm"
