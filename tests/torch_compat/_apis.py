"""The two APIs a compatibility case runs against: the same names, imported from torch or from
hyperpar. A case is written once, as a function of such a namespace (only the imports differ).

(Tests may import torch.distributed; the library may not.)
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace
from typing import Any

#: name -> the torch module a torch user imports it from
TORCH_NAMES = {
    "init_device_mesh": "torch.distributed.device_mesh",
    "DeviceMesh": "torch.distributed.device_mesh",
    **{n: "torch.distributed.tensor" for n in (
        "DTensor", "Partial", "Placement", "Replicate", "Shard", "distribute_module",
        "distribute_tensor")},
    **{n: "torch.distributed.tensor.parallel" for n in (
        "ColwiseParallel", "ParallelStyle", "PrepareModuleInput", "PrepareModuleInputOutput",
        "PrepareModuleOutput", "RowwiseParallel", "SequenceParallel", "loss_parallel",
        "parallelize_module")},
}


def missing_in_torch() -> set[str]:
    """The names of ``TORCH_NAMES`` the installed torch lacks (``PrepareModuleInputOutput``
    before torch 2.7): cases using them are skipped there, with the reason."""
    return {n for n, m in TORCH_NAMES.items()
            if not hasattr(importlib.import_module(m), n)}


def torch_api() -> SimpleNamespace:
    """``torch.distributed.tensor(.parallel)``, as a user of torch imports it (without the
    names this torch release lacks)."""
    return SimpleNamespace(name="torch", **{
        n: getattr(importlib.import_module(m), n) for n, m in TORCH_NAMES.items()
        if n not in missing_in_torch()})


def hyperpar_api() -> SimpleNamespace:
    """The same names from hyperpar (what a migrated script imports)."""
    import hyperpar

    return SimpleNamespace(name="hyperpar", **{n: getattr(hyperpar, n) for n in TORCH_NAMES})


def api_named(name: str) -> Any:
    return {"torch": torch_api, "hyperpar": hyperpar_api}[name]()
