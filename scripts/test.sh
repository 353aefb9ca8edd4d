#!/usr/bin/env bash
# Set up (idempotent) and run every check: lint, unit + multi-process tests, the backend
# conformance kit on cpu (2 and 4 ranks) and on the emulated npu, and the docs build.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
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
pytest -q -p no:cacheprovider tests "$@"
echo "== torch compatibility: oldest supported and newest available torch"; bash scripts/test-compat.sh
