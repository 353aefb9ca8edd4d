"""Policies of :func:`hyperpar.fully_shard`: mixed precision and parameter offload.

The names and defaults follow torch FSDP2 (``torch.distributed.fsdp``), so a script written for
it reads the same here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["CPUOffloadPolicy", "MixedPrecisionPolicy", "OffloadPolicy"]


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

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for field in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, field)
            if value is None:
                continue
            if not isinstance(value, torch.dtype):
                raise TypeError(f"MixedPrecisionPolicy: {field} must be a torch.dtype or None, "
                                f"got {value!r}")
            if not value.is_floating_point:
                raise ValueError(
                    f"MixedPrecisionPolicy: {field}={value} is not a floating dtype; "
                    "parameters, gradients and outputs are cast to it, which needs a floating "
                    "dtype such as torch.bfloat16, torch.float16 or torch.float32")


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
