"""Tensor and sequence parallelism: the API of ``torch.distributed.tensor.parallel`` on any
hyperpar backend, plus explicit Megatron-style layers.

Styles shard parameters as DTensors but run Linear/Embedding forwards on local shards,
communicating only at module boundaries (see :mod:`hyperpar.torch.parallel.style`).
"""

# The torch stack loads only where torch is installed: a MindSpore-only venv still gets the
# framework-neutral part of this package (the style specs in spec.py).

from .driver import (
    AlreadyParallelizedError,
    PlanKeyError,
    TiedParameterError,
    UnsupportedModuleError,
    parallelize_module,
)
from .easydel import (
    TensorParallelConfig,
    get_matmul_output_sharding,
    get_output_partition_spec,
    get_sharding,
    matmul_output_placements,
)

try:
    import torch as _torch  # noqa: F401
except ImportError:  # pragma: no cover - exercised by tests/test_layering.py
    _torch = None

if _torch is not None:
    from hyperpar.torch import alias_submodules as _alias
    from hyperpar.torch.moe.styles import ExpertParallel, ExpertTensorParallel, TensorParallel
    from hyperpar.torch.parallel.api import distribute_module, from_torch_style
    from hyperpar.torch.parallel.layers import (
        ColumnParallelLinear,
        ParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
    )
    from hyperpar.torch.parallel.loss import loss_parallel, vocab_parallel_cross_entropy
    from hyperpar.torch.parallel.prepare import (
        PrepareModuleInput,
        PrepareModuleInputOutput,
        PrepareModuleOutput,
    )
    from hyperpar.torch.parallel.style import (
        ColwiseParallel,
        ParallelStyle,
        RowwiseParallel,
        SequenceParallel,
    )

    from .context import ContextParallelError, context_parallel, context_parallel_unshard
    from .data_parallel import DataParallelModule, data_parallel

    # The torch files live under hyperpar/torch/; their old paths stay importable.
    _alias(
        "hyperpar.torch.parallel",
        __name__,
        ("style", "prepare", "api", "_comm", "loss", "layers", "_debug_checks"),
    )

__all__ = [
    "AlreadyParallelizedError",
    "ColumnParallelLinear",
    "ColwiseParallel",
    "ContextParallelError",
    "DataParallelModule",
    "ExpertParallel",
    "ExpertTensorParallel",
    "ParallelLinear",
    "ParallelStyle",
    "PlanKeyError",
    "PrepareModuleInput",
    "PrepareModuleInputOutput",
    "PrepareModuleOutput",
    "RowParallelLinear",
    "RowwiseParallel",
    "SequenceParallel",
    "TiedParameterError",
    "TensorParallel",
    "TensorParallelConfig",
    "UnsupportedModuleError",
    "VocabParallelEmbedding",
    "context_parallel",
    "context_parallel_unshard",
    "data_parallel",
    "distribute_module",
    "from_torch_style",
    "get_matmul_output_sharding",
    "get_output_partition_spec",
    "get_sharding",
    "loss_parallel",
    "matmul_output_placements",
    "parallelize_module",
    "vocab_parallel_cross_entropy",
]
