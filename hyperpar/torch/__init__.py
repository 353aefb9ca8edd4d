"""The torch stack: DTensor and tensor parallelism's tensor mechanics for PyTorch.

Everything here is about torch tensors and modules -- the ``DTensor`` subclass and its
``__torch_function__`` dispatch with the torch-keyed op table (``dtensor/``), the
differentiable boundary collectives, parameter swaps and hooks of the parallel styles
(``parallel/``). What is about layouts -- the mesh, placements, shard arithmetic, the
redistribution planner, the op rules by neutral name, the style specs, the one
``parallelize_module`` -- lives in the framework-neutral ``hyperpar.dtensor`` and
``hyperpar.parallel`` modules; MindSpore's mechanics live in the ``hyperpar-mindspore`` backend.

Users import from ``hyperpar``, ``hyperpar.dtensor`` or ``hyperpar.parallel``; the older
module paths (``hyperpar.dtensor.random``, ``hyperpar.parallel.style``...) stay importable as
aliases of the modules here (:func:`alias_submodules`). This package itself imports no framework.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterable

__all__ = ["alias_submodules"]


def alias_submodules(src_pkg: str, dst_pkg: str, names: Iterable[str]) -> None:
    """Import ``src_pkg.<name>`` for each name and make it, and every module loaded below it,
    importable as ``dst_pkg.<...>`` too: the same module objects, so classes stay identical.

    Aliasing the submodules as well matters: ``import dst_pkg._ops.dispatch`` would otherwise
    load a second copy of ``dispatch`` through the aliased package's ``__path__``.
    """
    for name in names:
        importlib.import_module(f"{src_pkg}.{name}")
    prefix = src_pkg + "."
    parent = sys.modules[dst_pkg]
    for full, module in list(sys.modules.items()):
        if not full.startswith(prefix) or module is None:
            continue
        tail = full[len(prefix):]
        sys.modules.setdefault(f"{dst_pkg}.{tail}", module)
        if "." not in tail and not hasattr(parent, tail):
            setattr(parent, tail, module)
