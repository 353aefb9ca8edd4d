#!/usr/bin/env bash
# Build (once) the cached torchtitan venv: torch 2.14.1 from the compat venv (reused through a
# .pth line, not copied: 5.5 GB) plus torchtitan 0.3.0 and its dependencies; then make two
# copies of the installed package under $TT_VENV/trees:
#   native/torchtitan    -- torchtitan + the CUDA patch (cuda_patch.py)
#   hyperpar/torchtitan  -- torchtitan + the same CUDA patch + rewrite_imports.py
#
#   bash scripts/torchtitan/setup.sh        # exit 0 when ready, 3 when it cannot be built
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/hyperpar
TT_VENV=${HYPERPAR_TORCHTITAN_VENV:-$CACHE/torchtitan-venv}
TORCH_VENV=${HYPERPAR_COMPAT_VENVS:-$CACHE/compat-venvs}/torch-2.14.1
PY=${PYTHON:-python3}
if [ ! -f "$TT_VENV/.complete" ]; then
  if [ ! -f "$TORCH_VENV/.complete" ]; then
    HYPERPAR_COMPAT_TORCH=2.14.1 bash "$ROOT/scripts/test-compat.sh" --prepare || exit 3
  fi
  rm -rf "$TT_VENV"
  "$PY" -m venv "$TT_VENV"
  site=$("$TT_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  tsite=$("$TORCH_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  # The torch venv's packages after this venv's own (a .pth path line; its own .pth files,
  # e.g. the editable hyperpar of /work/main, are not processed: PYTHONPATH picks hyperpar).
  echo "$tsite" > "$site/zz-torch-2.14.1.pth"
  "$TT_VENV/bin/python" -m pip install -q "torchtitan==0.3.0" || { rm -rf "$TT_VENV"; exit 3; }
  touch "$TT_VENV/.complete"
fi
# The two patched trees are rebuilt on every run (cheap; the scripts may have changed).
src=$("$TT_VENV/bin/python" -c 'import torchtitan, os; print(os.path.dirname(torchtitan.__file__))')
rm -rf "$TT_VENV/trees"
for flavour in native hyperpar; do
  mkdir -p "$TT_VENV/trees/$flavour"
  cp -r "$src" "$TT_VENV/trees/$flavour/torchtitan"
  find "$TT_VENV/trees/$flavour" -name __pycache__ -prune -exec rm -rf {} +
done
# The CUDA patch first (its anchors are torchtitan's own lines), then the import rewrite.
for flavour in native hyperpar; do
  "$TT_VENV/bin/python" "$HERE/cuda_patch.py" "$TT_VENV/trees/$flavour/torchtitan"
done
"$TT_VENV/bin/python" "$HERE/rewrite_imports.py" "$TT_VENV/trees/hyperpar/torchtitan"
echo "torchtitan trees ready under $TT_VENV/trees"
