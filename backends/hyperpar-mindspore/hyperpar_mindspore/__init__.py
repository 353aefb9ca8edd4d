"""hyperpar backend for MindSpore: the Platform (collectives, groups, Cell hooks, devices) and
tensor parallelism on ``nn.Cell`` models with hyperpar's plan syntax, and DTensor
(:mod:`hyperpar_mindspore.dtensor`).

>>> from hyperpar import init_device_mesh, parallelize_module   # doctest: +SKIP
>>> from hyperpar import ColwiseParallel, RowwiseParallel       # doctest: +SKIP

With ``HYPERPAR_BACKEND=mindspore`` those top-level names resolve here (through
``MindSporePlatform.parallel_api()``); importing from ``hyperpar_mindspore`` works too.

The mesh is hyperpar's one framework-neutral ``DeviceMesh`` (:mod:`hyperpar.dtensor.mesh`),
re-exported here. Names are resolved lazily: ``import hyperpar_mindspore`` does not import
MindSpore.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

_EXPORTS = {
    "MindSporePlatform": ".platform",
    "DeviceMesh": "hyperpar.dtensor.mesh",
    "init_device_mesh": "hyperpar.dtensor.mesh",
    "DTensor": ".dtensor",
    "distribute_tensor": ".dtensor",
    "Shard": ".dtensor",
    "Replicate": ".dtensor",
    "Partial": ".dtensor",
    "ParallelStyle": ".parallel",
    "ColwiseParallel": ".parallel",
    "RowwiseParallel": ".parallel",
    "UnsupportedModuleError": ".parallel",
    "parallelize_module": ".parallel",
    "PlanKeyError": ".parallel",
    "AlreadyParallelizedError": ".parallel",
    "TiedParameterError": ".parallel",
    "loss_parallel": ".loss",
    "vocab_parallel_cross_entropy": ".loss",
    "ColumnParallelLinear": ".layers",
    "RowParallelLinear": ".layers",
    "VocabParallelEmbedding": ".layers",
    "SequenceParallel": ".prepare",
    "PrepareModuleInput": ".prepare",
    "PrepareModuleOutput": ".prepare",
    "PrepareModuleInputOutput": ".prepare",
    "data_parallel": ".data_parallel",
    "DataParallelCell": ".data_parallel",
    "reduce_gradients": ".data_parallel",
    "fully_shard": ".fully_shard",
    "ExpertParallel": ".moe_styles",
    "ExpertTensorParallel": ".moe_styles",
    "TensorParallel": ".moe_styles",
    "FullyShardedCell": ".fully_shard",
    "MixedPrecisionPolicy": "hyperpar.fsdp.policy",
    # hyperpar.pipeline's framework-bound names, asked for through Platform.parallel_api()
    "PipelineModule": ".pipeline",
    "PipelineEngine": ".pipeline_engine",
    "PipelineSchedule": ".pipeline_engine",
    "ScheduleGPipe": ".pipeline_engine",
    "Schedule1F1B": ".pipeline_engine",
    "ScheduleInterleaved1F1B": ".pipeline_engine",
    "ScheduleZeroBubble": ".pipeline_engine",
    "ScheduleInterleavedZeroBubble": ".pipeline_engine",
    "get_schedule_class": ".pipeline_engine",
    "initialize": ".pipeline_engine",
}

__all__ = sorted(_EXPORTS)


class _Package(types.ModuleType):
    """This package's module type: two exports share their submodule's name (``fully_shard``,
    ``data_parallel``), and importing such a submodule (``from .fully_shard import ...``
    anywhere) would otherwise replace the exported function on the package with the module,
    so ``from hyperpar import fully_shard`` would hand a user the module."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and _EXPORTS.get(name) == f".{name}":
            return  # the submodule stays in sys.modules; the export keeps the name
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hyperpar_mindspore' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)  # relative or absolute
    globals()[name] = value
    return value
