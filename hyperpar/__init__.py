"""hyperpar: hardware-agnostic tensor, sequence, pipeline and data parallelism for PyTorch
and MindSpore.

Public names are re-exported lazily (PEP 562) so ``import hyperpar`` stays cheap and never
resolves a backend. Importing a framework-bound name (``from hyperpar import
parallelize_module``) does: it is taken from the selected platform's framework.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    # platform
    "Platform": "hyperpar.platform",
    "get_platform": "hyperpar.platform",
    "set_backend": "hyperpar.platform",
    "BackendError": "hyperpar.platform",
    "DeviceCapacityError": "hyperpar.platform",
    "P2POp": "hyperpar.platform",
    "CollectiveError": "hyperpar.platform.health",
    "CollectiveMismatchError": "hyperpar.platform.health",
    # dtensor
    "DeviceMesh": "hyperpar.dtensor",
    "init_device_mesh": "hyperpar.dtensor",
    "DTensor": "hyperpar.dtensor",
    "Shard": "hyperpar.dtensor",
    "Replicate": "hyperpar.dtensor",
    "Partial": "hyperpar.dtensor",
    "Placement": "hyperpar.dtensor",
    "distribute_tensor": "hyperpar.dtensor",
    "local_map": "hyperpar.dtensor",
    "current_mesh": "hyperpar.dtensor",
    "MeshDimError": "hyperpar.dtensor",
    "ShardingError": "hyperpar.dtensor",
    # parallel
    "ColwiseParallel": "hyperpar.parallel",
    "RowwiseParallel": "hyperpar.parallel",
    "SequenceParallel": "hyperpar.parallel",
    "PrepareModuleInput": "hyperpar.parallel",
    "PrepareModuleOutput": "hyperpar.parallel",
    "PrepareModuleInputOutput": "hyperpar.parallel",
    "ParallelStyle": "hyperpar.parallel",
    "parallelize_module": "hyperpar.parallel.driver",
    "distribute_module": "hyperpar.parallel",
    "loss_parallel": "hyperpar.parallel",
    "ColumnParallelLinear": "hyperpar.parallel",
    "RowParallelLinear": "hyperpar.parallel",
    "VocabParallelEmbedding": "hyperpar.parallel",
    "ParallelLinear": "hyperpar.parallel",
    "TensorParallelConfig": "hyperpar.parallel",
    "PlanKeyError": "hyperpar.parallel.driver",
    "UnsupportedModuleError": "hyperpar.parallel.driver",
    "AlreadyParallelizedError": "hyperpar.parallel.driver",
    "TiedParameterError": "hyperpar.parallel.driver",
    "data_parallel": "hyperpar.parallel",
    "DataParallelModule": "hyperpar.parallel",
    "context_parallel": "hyperpar.parallel",
    "context_parallel_unshard": "hyperpar.parallel",
    "ContextParallelError": "hyperpar.parallel",
    "ExpertParallel": "hyperpar.parallel",
    "ExpertTensorParallel": "hyperpar.parallel",
    "TensorParallel": "hyperpar.parallel",
    # fsdp
    "fully_shard": "hyperpar.fsdp",
    "FSDPModule": "hyperpar.fsdp",
    "MixedPrecisionPolicy": "hyperpar.fsdp",
    "CPUOffloadPolicy": "hyperpar.fsdp",
    "OffloadPolicy": "hyperpar.fsdp",
    "clip_grad_norm_": "hyperpar.fsdp",
    "register_fsdp_forward_method": "hyperpar.fsdp",
    # pipeline
    "LayerSpec": "hyperpar.pipeline",
    "TiedLayerSpec": "hyperpar.pipeline",
    "PipelineModule": "hyperpar.pipeline",
    "PipelineSchedule": "hyperpar.pipeline",
    "ScheduleGPipe": "hyperpar.pipeline",
    "Schedule1F1B": "hyperpar.pipeline",
    "ScheduleInterleaved1F1B": "hyperpar.pipeline",
    "ScheduleZeroBubble": "hyperpar.pipeline",
    "get_schedule_class": "hyperpar.pipeline",
    "PipelineEngine": "hyperpar.pipeline",
    # inspect
    "InspectedModel": "hyperpar.inspect",
    "HookFunction": "hyperpar.inspect",
    "ShapeMismatchError": "hyperpar.inspect",
    "FlexModel": "hyperpar.inspect",
    # testing
    "run_distributed": "hyperpar.testing",
    "WorkerPool": "hyperpar.testing",
    "DistributedError": "hyperpar.testing",
}

#: names whose implementation depends on the framework: resolved at each access through the
#: platform's ``parallel_api()`` (MindSpore Cells), else hyperpar's PyTorch implementation above.
_FRAMEWORK_BOUND = frozenset({
    "DeviceMesh", "init_device_mesh", "DTensor", "distribute_tensor", "ParallelStyle",
    "ColwiseParallel", "RowwiseParallel", "SequenceParallel", "PrepareModuleInput",
    "PrepareModuleOutput", "PrepareModuleInputOutput", "loss_parallel", "data_parallel",
    "fully_shard", "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
    "ExpertParallel", "ExpertTensorParallel", "TensorParallel",
})

#: subpackages reachable as attributes (``hyperpar.checkpoint.save``)
_SUBMODULES = ("checkpoint", "dtensor", "fsdp", "inspect", "parallel", "pipeline", "platform",
               "testing")

#: subpackages left out of ``from hyperpar import *``: their names would shadow the standard
#: library's ``inspect`` and ``platform`` modules in the importing namespace.
_NOT_STARRED = ("inspect", "platform")

#: modules that import no framework: what ``from hyperpar import *`` offers without torch
_FRAMEWORK_FREE = ("hyperpar.platform", "hyperpar.parallel.driver")



def _torch_installed() -> bool:
    try:
        return importlib.util.find_spec("torch") is not None
    except ImportError:  # an import hook that refuses torch: not usable here either
        return False


if _torch_installed():
    __all__ = sorted(_EXPORTS) + ["__version__",
                                  *(name for name in _SUBMODULES if name not in _NOT_STARRED)]
else:  # e.g. a MindSpore venv: the torch stack (DTensor, fully_shard, ...) is not importable
    __all__ = sorted(name for name, module in _EXPORTS.items()
                     if module in _FRAMEWORK_FREE or name in _FRAMEWORK_BOUND) + ["__version__"]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"hyperpar.{name}")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hyperpar' has no attribute {name!r}")
    if name in _FRAMEWORK_BOUND:
        return _framework_bound(name, module)
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def _framework_bound(name: str, torch_module: str) -> Any:
    """``name`` from the selected platform's framework API (not cached: ``set_backend`` may
    switch frameworks); hyperpar's PyTorch implementation when the platform has none."""
    from hyperpar.platform import BackendError, get_platform

    try:
        api = get_platform().parallel_api()
    except BackendError:
        if importlib.util.find_spec("torch") is None:
            raise
        api = None  # torch is here: its styles need a backend only when applied
    if api is None:
        return getattr(importlib.import_module(torch_module), name)
    try:
        return getattr(api, name)
    except AttributeError:
        raise AttributeError(
            f"hyperpar.{name} has no implementation on the {get_platform().name!r} backend yet "
            f"({api.__name__} lacks it); see its documentation for what it supports"
        ) from None


def __dir__() -> list[str]:
    return sorted({*__all__, *_SUBMODULES})
