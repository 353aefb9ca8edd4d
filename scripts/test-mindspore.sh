#!/usr/bin/env bash
# The MindSpore backend's checks, in a venv with MindSpore and no torch (cached across runs).
#   MS_VENV (default ~/.cache/hyperpar/mindspore-venv, outside the checkout so clones share it)
#   bash scripts/test-mindspore.sh --prepare   # only build the venv (scripts/test.sh runs this in
#                                              # the background during the main suite)
# Without a network and without the cached venv, says so and exits 0 (nothing was checked) --
# except under CI=true, where that is an error.
set -euo pipefail
cd "$(dirname "$0")/.."
MS_VENV=${MS_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/hyperpar/mindspore-venv}
PREPARE=0
[ "${1:-}" = "--prepare" ] && { PREPARE=1; shift; }
PY=${PYTHON:-python3}
start=$(date +%s)
if [ ! -x "$MS_VENV/bin/python" ] || ! "$MS_VENV/bin/python" -c "import mindspore, pluggy, pytest, safetensors.numpy" 2>/dev/null; then
  echo "== building $MS_VENV (MindSpore 2.10, numpy<2, no torch)"
  "$PY" -m venv "$MS_VENV"
  if ! "$MS_VENV/bin/python" -m pip install -q "numpy<2" "mindspore==2.10.0" pluggy pytest pytest-timeout safetensors \
      "setuptools>=77"; then
    rm -rf "$MS_VENV"
    if [ "${CI:-}" = "true" ]; then
      echo "error: could not install MindSpore into $MS_VENV (see pip's message above)" >&2
      exit 1
    fi
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
[ $PREPARE = 1 ] && exit 0
export GLOG_v=${GLOG_v:-3}
echo "== hyperpar info (mindspore, no torch)"
HYPERPAR_BACKEND=mindspore "$MS_VENV/bin/hyperpar" info
echo "== MindSpore backend tests and the one-body-two-frameworks tests (real processes, 2 and 4 ranks)"
# tests/mindspore/test_checkpoint.py runs its torch half in the torch venv (this checkout's .venv,
# or $HYPERPAR_TORCH_PYTHON); without one that test is skipped, saying so.
"$MS_VENV/bin/python" -m pytest -q -p no:cacheprovider --durations=15 tests/mindspore tests/both "$@"
echo "== hyperpar run -n 2 examples/mindspore_tp_mlp.py"
HYPERPAR_BACKEND=mindspore timeout 600 "$MS_VENV/bin/hyperpar" run -n 2 examples/mindspore_tp_mlp.py
for n in 2 4; do
  echo "== hyperpar run -n $n examples/mindspore_dtensor_tp.py (DTensor ops, TP + SP, loss_parallel)"
  HYPERPAR_BACKEND=mindspore timeout 900 "$MS_VENV/bin/hyperpar" run -n $n \
    examples/mindspore_dtensor_tp.py
done
echo "== done in $(( $(date +%s) - start )) s"
