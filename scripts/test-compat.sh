#!/usr/bin/env bash
# Compatibility job: the supported torch range, tested at both ends. For the oldest supported
# torch and the newest one available, in a cached venv of its own, run `hyperpar info`, the
# conformance kit (cpu), the demo, tests/compile and a parity subset of TP, FSDP, pipeline,
# checkpoint and the torch side-by-side cases.
#
#   bash scripts/test-compat.sh                      # both ends of the range
#   HYPERPAR_COMPAT_TORCH="2.9.1" bash scripts/test-compat.sh
#   bash scripts/test-compat.sh --prepare            # only build the venvs (scripts/test.sh runs
#                                                    # this in the background during the suite)
#
# A venv that cannot be built (no network) is reported as SKIPPED and the job exits 0, except
# under CI=true, where it is an error: CI must not pass without having tested the range.
#
# Venvs live in $HYPERPAR_COMPAT_VENVS (default ~/.cache/hyperpar/compat-venvs/torch-X.Y.Z),
# outside the checkout, so a fresh clone reuses them; a venv is (re)built only when its
# `.complete` marker is missing. PyPI ships torch for Linux x86_64 as a CUDA build: its nvidia-*
# wheels are needed even on the CPU (torch imports libcudart at start-up), about 5.5 GB a venv.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VERSIONS=${HYPERPAR_COMPAT_TORCH:-"2.6.0 2.14.1"}
VENVS=${HYPERPAR_COMPAT_VENVS:-${XDG_CACHE_HOME:-$HOME/.cache}/hyperpar/compat-venvs}
PY=${PYTHON:-python3}
TEST_DEPS=("pluggy>=1.3" "pytest>=8" "pytest-timeout>=2.2" "hypothesis>=6" "numpy"
           "safetensors>=0.4" "setuptools>=77")
# The parity subset: each file compares with the same model in one process or with torch's
# own TP/DTensor on the same script.
PARITY=(tests/parallel/test_tp_parity.py tests/fsdp/test_fully_shard.py
        tests/pipeline/test_pipeline_parity.py tests/checkpoint/test_checkpoint.py
        tests/torch_compat/test_compat.py tests/torch_compat/test_tp_dropin.py)

now() { date +%s; }
FAILED=()
step() {  # step VERSION NAME COMMAND...: run, time, and record a failure without stopping
  local version=$1 name=$2 t rc=0
  shift 2
  t=$(now)
  "$@" || rc=$?
  echo "-- torch $version, $name: $( [ $rc = 0 ] && echo ok || echo "FAILED (exit $rc)" ), $(( $(now) - t )) s"
  [ $rc = 0 ] || FAILED+=("torch $version: $name")
}
PREPARE=0
[ "${1:-}" = "--prepare" ] && PREPARE=1
build_venv() {  # build_venv VERSION VENV: (re)build unless complete; non-zero if pip fails
  local version=$1 venv=$2
  [ -f "$venv/.complete" ] && return 0
  rm -rf "$venv"
  "$PY" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  "$venv/bin/python" -m pip install -q "torch==$version" "${TEST_DEPS[@]}" || return 1
  touch "$venv/.complete"
}
if [ $PREPARE = 1 ]; then
  for version in $VERSIONS; do
    t0=$(now)
    build_venv "$version" "$VENVS/torch-$version" || { echo "could not build torch $version"; exit 1; }
    echo "-- torch $version venv ready in $(( $(now) - t0 )) s"
  done
  exit 0
fi
ORIG_PATH=$PATH
job_start=$(now)
export HYPERPAR_BACKEND=cpu
for version in $VERSIONS; do
  venv="$VENVS/torch-$version"
  echo "== torch $version ($venv)"
  t0=$(now)
  if ! build_venv "$version" "$venv"; then
    if [ "${CI:-}" = "true" ]; then
      echo "error: could not install torch $version into $venv (see pip's message above)" >&2
      exit 1
    fi
    echo "== SKIPPED torch $version: could not install it into $venv (no network?)"
    continue
  fi
  # This checkout, editable (re-pointed on every run; no build isolation: fast and offline).
  "$venv/bin/python" -m pip install -q --no-deps --no-build-isolation \
    -e . -e backends/hyperpar-cpu >/dev/null
  echo "-- venv ready in $(( $(now) - t0 )) s"
  export PATH="$venv/bin:$ORIG_PATH"
  python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$version')" || {
    echo "venv $venv does not hold torch $version"; exit 1; }
  # Every step runs (a failure is recorded, not fatal), so one run measures the whole range.
  step "$version" info hyperpar info
  step "$version" "conformance kit" python -m pytest -q -p no:cacheprovider \
    --pyargs hyperpar.testing.conformance --hyperpar-backend=cpu
  step "$version" demo bash -c "cd \"\$(mktemp -d)\" && python \"$ROOT/examples/demo.py\""
  step "$version" tests/compile python -m pytest -q -p no:cacheprovider tests/compile
  step "$version" "parity subset" python -m pytest -q -p no:cacheprovider "${PARITY[@]}"
  echo "== torch $version: $(( $(now) - t0 )) s"
done
echo "== compatibility job: $(( $(now) - job_start )) s"
if [ ${#FAILED[@]} -gt 0 ]; then
  printf 'FAILED: %s\n' "${FAILED[@]}"
  exit 1
fi
