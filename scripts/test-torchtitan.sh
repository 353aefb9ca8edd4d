#!/usr/bin/env bash
# torchtitan 0.3.0 on hyperpar: build (once) the cached venv and the patched trees, then run
# tests/torchtitan (llama3 debugmodel, 6 steps, FSDP / PP 1F1B / PP interleaved / CP on 2 CPU ranks,
# native vs hyperpar; about 8 min on 2 shared cores). Without a network the venv cannot be built: the job
# says SKIPPED and exits 0 (under CI=true that is an error).
#
#   bash scripts/test-torchtitan.sh
set -euo pipefail
cd "$(dirname "$0")/.."
rc=0
bash scripts/torchtitan/setup.sh || rc=$?
if [ $rc = 3 ]; then
  if [ "${CI:-}" = "true" ]; then
    echo "error: could not build the torchtitan venv (see pip's message above)" >&2
    exit 1
  fi
  echo "== SKIPPED torchtitan: could not build its venv (no network?)"
  exit 0
fi
[ $rc = 0 ] || exit $rc
export HYPERPAR_TORCHTITAN=1 OMP_NUM_THREADS=1
exec python -m pytest -q -p no:cacheprovider tests/torchtitan "$@"
