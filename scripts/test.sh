#!/usr/bin/env bash
# Set up (idempotent) and run every check: lint, the backend conformance kit on cpu (1, 2 and 4
# ranks), on the emulated npu and on the tracing example backend, the docs build, the unit and
# multi-process tests, then the torch-version job (oldest and newest supported torch) and the
# MindSpore backend (a venv without torch). Arguments go to the main pytest run.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
# The two extra venvs (torch 2.6 / 2.14 for the version job, MindSpore for its backend) are
# mostly downloads and unpacking: build them in the background while the main suite runs.
logs=$(mktemp -d)
bash scripts/test-compat.sh --prepare >"$logs/compat.log" 2>&1 &
compat_prep=$!
bash scripts/test-mindspore.sh --prepare >"$logs/mindspore.log" 2>&1 &
ms_prep=$!
echo "== ruff"
ruff check hyperpar backends tests benchmarks examples
echo "== conformance kit: cpu"
pytest -q -p no:cacheprovider --pyargs hyperpar.testing.conformance --hyperpar-backend=cpu
echo "== conformance kit: npu (emulated on CPU: torch_npu module faked, HCCL mapped to gloo)"
pytest -q -p no:cacheprovider --pyargs hyperpar.testing.conformance --hyperpar-backend=npu \
  --hyperpar-emulate
echo "== conformance kit: tracing (the out-of-tree example backend in examples/backend-template)"
pytest -q -p no:cacheprovider --pyargs hyperpar.testing.conformance --hyperpar-backend=tracing
if [ -f mkdocs.yml ]; then
  echo "== docs"
  mkdocs build --strict --quiet --site-dir "$(mktemp -d)"
fi
echo "== unit and multi-process tests"
pytest -q -p no:cacheprovider --durations=25 tests "$@"
echo "== (main checks done in $(( $(date +%s) - start )) s)"
# A failed background build is reported here; the job scripts then retry it themselves and
# decide (skip without a network, fail under CI=true).
wait $compat_prep || { echo "== building the torch-version venvs failed:"; tail -20 "$logs/compat.log"; }
wait $ms_prep || { echo "== building the MindSpore venv failed:"; tail -20 "$logs/mindspore.log"; }
cat "$logs/compat.log" "$logs/mindspore.log"
# The torch-version job and the MindSpore job use separate venvs and ports: run them side by
# side (together ~16 min in a row on 2 cores, the CI limit is 45 min), then show each log whole.
echo "== torch compatibility (oldest and newest torch) and the MindSpore backend, side by side"
part=$(date +%s)
bash scripts/test-compat.sh >"$logs/compat-run.log" 2>&1 &
compat=$!
bash scripts/test-mindspore.sh >"$logs/mindspore-run.log" 2>&1 &
mindspore=$!
compat_rc=0
wait $compat || compat_rc=$?
mindspore_rc=0
wait $mindspore || mindspore_rc=$?
echo "== torch compatibility: oldest supported and newest available torch (exit $compat_rc)"
cat "$logs/compat-run.log"
echo "== MindSpore backend, venv without torch (exit $mindspore_rc)"
cat "$logs/mindspore-run.log"
echo "== both jobs done in $(( $(date +%s) - part )) s"
if [ "$compat_rc" -ne 0 ] || [ "$mindspore_rc" -ne 0 ]; then
  echo "== FAILED: torch-version job exit $compat_rc, MindSpore job exit $mindspore_rc"
  exit 1
fi
echo "== all checks passed in $(( $(date +%s) - start )) s"
