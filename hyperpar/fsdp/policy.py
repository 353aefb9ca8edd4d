"""Policies of :func:`hyperpar.fully_shard`: mixed precision and parameter offload.

The names and defaults follow torch FSDP2 (``torch.distributed.fsdp``), so a script written for
it reads the same here. This module imports no framework: one policy class serves
``fully_shard`` on torch modules and on MindSpore Cells, with each framework's own dtypes
(``torch.float16`` / ``mindspore.float16``); each ``fully_shard`` checks that the dtypes are its
framework's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["CPUOffloadPolicy", "DataParallelMeshDims", "FSDPMeshInfo", "MixedPrecisionPolicy",
           "OffloadPolicy", "ShardPlacementResult"]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """How a fully-sharded module casts parameters, gradients and activations.

    Args:
        param_dtype: dtype of the unsharded (all-gathered) parameters used in forward and
            backward; the sharded parameters the optimizer sees keep their own dtype. The cast
            happens before the all-gather, so communication moves ``param_dtype`` too.
            ``None``: no cast.
        reduce_dtype: dtype of the gradient reduce-scatter (and HSDP all-reduce). ``None``:
            ``param_dtype`` (or the parameter dtype without one).
        output_dtype: cast floating-point forward outputs to this dtype (``None``: no cast).
        cast_forward_inputs: cast floating-point forward inputs to ``param_dtype``.
    """

    param_dtype: Any = None
    reduce_dtype: Any = None
    output_dtype: Any = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for field in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, field)
            if value is None:
                continue
            floating = dtype_is_floating(value)
            if floating is None:
                raise TypeError(f"MixedPrecisionPolicy: {field} must be a torch.dtype, a "
                                f"mindspore dtype or None, got {value!r}")
            if not floating:
                raise ValueError(
                    f"MixedPrecisionPolicy: {field}={value!r} is not a floating dtype; "
                    "parameters, gradients and outputs are cast to it, which needs a floating "
                    "dtype such as torch.bfloat16, torch.float16 or torch.float32 "
                    "(mindspore.float16, mindspore.float32 on MindSpore)")


def dtype_is_floating(value: Any) -> bool | None:
    """Whether ``value`` is a floating dtype of torch or MindSpore; ``None`` when it is neither
    framework's dtype. Read from the object (no framework is imported here)."""
    module = type(value).__module__.split(".")[0]
    if module == "torch" and type(value).__name__ == "dtype":
        return bool(value.is_floating_point)
    if module == "mindspore":  # mindspore._c_expression.typing: Float, BFloat, Int, Bool, ...
        return type(value).__name__ in ("Float", "BFloat")
    return None


@dataclass(frozen=True)
class OffloadPolicy:
    """No offloading (the default): sharded parameters, gradients and optimizer states stay on
    the compute device."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep the sharded parameters, their gradients and therefore the optimizer states in host
    memory; each unshard copies the shard to the compute device before the all-gather and each
    reduce-scatter copies the gradient shard back. The optimizer steps on the host.

    Args:
        pin_memory: pin the host shards (faster copies) where the platform supports it.
    """

    pin_memory: bool = True


@dataclass
class DataParallelMeshDims:
    """Which named dims of a full SPMD mesh are data-parallel (torch FSDP2's type of the same
    name, for ``fully_shard(..., dp_mesh_dims=...)``). ``shard``: the dim name(s) FSDP shards
    over (several are flattened); ``replicate``: HSDP/DDP replication dim name(s). hyperpar's
    ``fully_shard`` does not take it yet: pass ``mesh=`` the data-parallel sub-mesh."""

    shard: str | tuple[str, ...] | None = None
    replicate: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.shard is None and self.replicate is None:
            raise ValueError("At least one of shard or replicate must be set in "
                             "DataParallelMeshDims")

    @property
    def shard_names(self) -> tuple[str, ...]:
        """The shard dim names as a tuple (empty without ``shard``)."""
        return _names(self.shard)

    @property
    def replicate_names(self) -> tuple[str, ...]:
        """The replicate dim names as a tuple (empty without ``replicate``)."""
        return _names(self.replicate)


def _names(value: str | tuple[str, ...] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


@dataclass
class FSDPMeshInfo:
    """The data-parallel mesh one parameter shards over (torch FSDP2's type of the same name,
    ``torch.distributed.fsdp._fully_shard._fsdp_common.FSDPMeshInfo``): ``mesh`` a hyperpar
    DeviceMesh, ``shard_mesh_dim`` the dim it shards over, ``replicate_mesh_dim`` the HSDP
    replication dim (or None)."""

    mesh: Any
    shard_mesh_dim: int | None = None
    replicate_mesh_dim: int | None = None

    def __post_init__(self) -> None:
        if self.shard_mesh_dim is None:
            raise ValueError("FSDPMeshInfo: shard_mesh_dim must be given (the mesh dim the "
                             "parameter shards over)")


@dataclass
class ShardPlacementResult:
    """What ``shard_placement_fn`` may return for one parameter (torch FSDP2's type of the same
    name): its placement (``Shard(dim)``, or None for ``Shard(0)``) and the data-parallel mesh
    it shards over -- e.g. a block's routed experts on their own ``efsdp`` mesh while its
    dense parameters use the ``mesh`` given to ``fully_shard``."""

    placement: Any
    mesh_info: Any
