#!/usr/bin/env bash
# Set up (idempotent) and run the main demo on the cpu backend.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
export HYPERPAR_BACKEND=${HYPERPAR_BACKEND:-cpu}
hyperpar info
echo
hyperpar run -n 2 examples/collectives_smoke.py
