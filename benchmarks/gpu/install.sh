#!/usr/bin/env bash
# On the GPU machine: install the carried wheels of folder $1 into /tmp/site (first on PYTHONPATH
# in the other scripts). /tmp/site lasts while the machine stays warm.
set -euo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$1"/*.whl
echo "installed $(ls "$1"/*.whl | wc -l) wheels from $1"
