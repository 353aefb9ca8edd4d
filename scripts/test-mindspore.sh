#!/usr/bin/env bash
# The MindSpore backend's checks, in a venv with MindSpore and no torch (cached across runs).
#   MS_VENV (default /work/venvs/mindspore if /work/venvs exists, else .venv-mindspore): the venv
# Without a network and without the cached venv, says so and exits 0 (nothing was checked).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${MS_VENV:-}" ]; then
  if [ -d /work/venvs ]; then MS_VENV=/work/venvs/mindspore; else MS_VENV="$PWD/.venv-mindspore"; fi
fi
PY=${PYTHON:-python3}
start=$(date +%s)
if [ ! -x "$MS_VENV/bin/python" ] || ! "$MS_VENV/bin/python" -c "import mindspore, pluggy, pytest" 2>/dev/null; then
  echo "== building $MS_VENV (MindSpore 2.10, numpy<2, no torch)"
  "$PY" -m venv "$MS_VENV"
  if ! "$MS_VENV/bin/python" -m pip install -q "numpy<2" "mindspore==2.10.0" pluggy pytest pytest-timeout \
      "setuptools>=77"; then
    echo "== SKIPPED the MindSpore checks: could not install MindSpore into $MS_VENV (no network?)"
    exit 0
  fi
fi
# Editable installs of this checkout (cheap; refreshes entry points), without dependencies: the
# core needs only pluggy, and torch must stay out.
log=$(mktemp)
if ! "$MS_VENV/bin/python" -m pip install -q --no-deps --no-build-isolation -e . \
    -e backends/hyperpar-mindspore >"$log" 2>&1; then
  cat "$log" >&2
  exit 1
fi
rm -f "$log"
if "$MS_VENV/bin/python" -c "import torch" 2>/dev/null; then
  echo "error: $MS_VENV has torch installed; the MindSpore checks need a venv without it" >&2
  exit 1
fi
echo "== venv ready in $(( $(date +%s) - start )) s"
export GLOG_v=${GLOG_v:-3}
echo "== hyperpar info (mindspore, no torch)"
HYPERPAR_BACKEND=mindspore "$MS_VENV/bin/hyperpar" info
echo "== MindSpore backend tests (real processes, 2 and 4 ranks)"
"$MS_VENV/bin/python" -m pytest -q -p no:cacheprovider tests/mindspore "$@"
echo "== hyperpar run -n 2 examples/mindspore_tp_mlp.py"
HYPERPAR_BACKEND=mindspore timeout 600 "$MS_VENV/bin/hyperpar" run -n 2 examples/mindspore_tp_mlp.py
echo "== done in $(( $(date +%s) - start )) s"
