"""The package's exported names survive imports of the submodules that share them.

``hyperpar_mindspore.fully_shard`` and ``.data_parallel`` are both exported functions and
submodules; Python sets a package attribute to a submodule when the submodule is first
imported, which once replaced the function (the pipeline engine imports both submodules), and
``from hyperpar import fully_shard`` then handed users a module. A fresh interpreter, because
the order of first imports is the point."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_PROBE = """
import types
import hyperpar_mindspore
import hyperpar_mindspore.pipeline_engine            # imports .fully_shard at module level
from hyperpar_mindspore.data_parallel import _Reducer  # noqa: F401  (as the engine does later)
from hyperpar import data_parallel, fully_shard
for f in (fully_shard, data_parallel, hyperpar_mindspore.fully_shard,
          hyperpar_mindspore.data_parallel):
    assert isinstance(f, types.FunctionType), f
print("ok")
"""


def test_exports_named_like_submodules_stay_the_functions() -> None:
    env = {**os.environ, "HYPERPAR_BACKEND": "mindspore", "GLOG_v": "3",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "backends/hyperpar-mindspore"),
                                          os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
