#!/usr/bin/env bash
# scripts/gpu-check.sh [OUT_DIR]: check hyperpar on a GPU host with no network, results in OUT_DIR.
#
#   1. install  this checkout and its backends into the host's Python, downloading nothing
#               (pip --no-deps --no-build-isolation --no-index -e ...)
#   2. info     `hyperpar info` (text and JSON): the backend selected, devices, ranks per host
#   3. kit      the backend conformance kit (world sizes the host can run; the rest skip)
#   4. tests    the device-relevant tests under HYPERPAR_BACKEND (multi-rank tests beyond the
#               visible devices skip with the reason -- the capacity check sizes them)
#   5. bench    `hyperpar bench` on the device (each benchmark at the ranks the host allows;
#               bench_llama: plain vs hyperpar vs torch-native TP, eager and compiled, peak
#               memory), then -- optional -- the CPU benchmarks at 2 and 4 ranks
#
# Every step runs even if an earlier one failed (except: no usable backend stops the run);
# OUT_DIR/summary.txt lists each step's exit status, OUT_DIR/<step>.log its output, and
# OUT_DIR/bench*/ the benchmark reports (results.md, results.json, ratios.png).
# Exit status: 0 when every step passed, 1 otherwise.
#
# Environment (all optional):
#   GPU_CHECK_BACKEND   backend to check (default cuda; `cpu` runs the same steps on the host,
#                       which is how this script is exercised on a machine without a GPU)
#   PYTHON              interpreter (default /opt/torch/.venv/bin/python3 when present, else
#                       python3)
#   GPU_CHECK_STEPS     steps to run (default "install info kit tests bench")
#   GPU_CHECK_TESTS     test paths for the tests step
#   GPU_CHECK_BENCH     benchmark names for `hyperpar bench` (default: all of benchmarks/)
#   GPU_CHECK_CPU_BENCH 1: also run the CPU benchmarks at 2 and 4 ranks (quiet cores there)
#   GPU_CHECK_TIMEOUT   seconds allowed per step (default 3600)
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD

backend=${GPU_CHECK_BACKEND:-cuda}
if [ -z "${PYTHON:-}" ]; then
  if [ -x /opt/torch/.venv/bin/python3 ]; then PYTHON=/opt/torch/.venv/bin/python3
  else PYTHON=python3; fi
fi
steps=${GPU_CHECK_STEPS:-install info kit tests bench}
tests=${GPU_CHECK_TESTS:-tests/platform tests/parallel/test_tp_parity.py tests/parallel/test_styles.py tests/checkpoint tests/compile tests/dtensor/test_dtensor.py}
step_timeout=${GPU_CHECK_TIMEOUT:-3600}
out=${1:-gpu-check-$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$out"
out=$(cd "$out" && pwd)
summary="$out/summary.txt"
: > "$summary"
failed=0

export HYPERPAR_BACKEND=$backend
export PYTHONUNBUFFERED=1

log() { echo "gpu-check: $*" | tee -a "$summary"; }

# run NAME CMD...: run a step with a time limit, its output in OUT/NAME.log, status in summary
run() {
  local name=$1; shift
  local start=$SECONDS
  echo "gpu-check: == $name: $*"
  timeout "$step_timeout" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  tail -n 5 "$out/$name.log" | sed 's/^/    /'
  log "$name: exit $rc in $((SECONDS - start)) s (log: $name.log)"
  [ "$rc" -eq 0 ] || failed=1
  return "$rc"
}

wants() { case " $steps " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

log "checkout $root ($(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo 'no git')), backend $backend, python $PYTHON, $(date -u '+%Y-%m-%d %H:%M UTC')"
"$PYTHON" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' \
  2>&1 | tee -a "$summary"
if command -v nvidia-smi > /dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
    > "$out/gpus.txt" 2>&1 && sed 's/^/gpu: /' "$out/gpus.txt" | tee -a "$summary"
fi

if wants install; then
  run install "$PYTHON" -m pip install -q --no-deps --no-build-isolation --no-index \
    -e . -e backends/hyperpar-cpu -e backends/hyperpar-cuda -e backends/hyperpar-npu
fi

if wants info; then
  run info "$PYTHON" -m hyperpar info --check
  "$PYTHON" -m hyperpar info --json > "$out/info.json" 2> /dev/null
  if ! "$PYTHON" -m hyperpar info --check > /dev/null 2>&1; then
    log "backend $backend is not usable here (see info.log): nothing else to check"
    exit 1
  fi
fi

if wants kit; then
  run kit "$PYTHON" -m pytest -q -p no:cacheprovider -rs --pyargs hyperpar.testing.conformance \
    "--hyperpar-backend=$backend"
fi

if wants tests; then
  # shellcheck disable=SC2086  # the list is word-split on purpose
  run tests "$PYTHON" -m pytest -q -p no:cacheprovider -rs $tests
fi

if wants bench; then
  # shellcheck disable=SC2086
  run bench "$PYTHON" -m hyperpar bench --out "$out/bench" ${GPU_CHECK_BENCH:-}
  if [ "${GPU_CHECK_CPU_BENCH:-0}" = 1 ]; then
    for n in 2 4; do
      HYPERPAR_BACKEND=cpu HYPERPAR_BENCH_RANKS=$n run "bench-cpu-$n" \
        "$PYTHON" -m hyperpar --backend cpu bench --out "$out/bench-cpu-$n" tp dp platform
    done
  fi
fi

log "done: $([ "$failed" -eq 0 ] && echo 'every step passed' || echo 'some steps FAILED') -- results in $out"
exit "$failed"
