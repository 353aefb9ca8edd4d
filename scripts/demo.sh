#!/usr/bin/env bash
# Set up (idempotent) and run the main demo on the cpu backend: a decoder trained with
# pipeline x tensor parallelism (pp2 x tp2, 4 processes), loss per step, and the parity check
# against the same model trained in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
export HYPERPAR_BACKEND=${HYPERPAR_BACKEND:-cpu}
hyperpar info
echo
python examples/demo.py "$@"
