#!/usr/bin/env bash
# Create .venv (if missing) and install hyperpar, its three backends and the test tools.
# torch is pinned to 2.13.* for the test set-up (users may run any torch >= 2.6).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q "torch==2.13.*" \
  -e ".[test,bench,docs]" \
  -e backends/hyperpar-cpu -e backends/hyperpar-cuda -e backends/hyperpar-npu \
  -e backends/hyperpar-sim -e examples/backend-template
