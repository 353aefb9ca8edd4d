"""DTensor factories: ``zeros``, ``ones``, ``empty``, ``full``, ``rand``, ``randn``.

Each rank allocates only its own shard. ``rand``/``randn`` use the offset-based generator of
:mod:`hyperpar.torch.dtensor.random`, so the result equals the same call made for the full tensor in
one process (``hyperpar.torch.dtensor.random.rand``) after the same seed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from hyperpar.dtensor.mesh import DeviceMesh, _require_mesh
from hyperpar.dtensor.placement import REPLICATE, Partial, Placement, normalize_placements
from hyperpar.platform import get_platform
from hyperpar.torch.dtensor import random as _random
from hyperpar.torch.dtensor.api import DTensor, DTensorSpec, _wrap


def _size(size: tuple) -> tuple[int, ...]:
    if len(size) == 1 and not isinstance(size[0], int):
        return tuple(int(s) for s in size[0])
    return tuple(int(s) for s in size)


def _make(size: tuple, fill: Callable[[tuple, DTensorSpec, torch.dtype, Any], torch.Tensor],
          *, dtype: torch.dtype | None, requires_grad: bool, device_mesh: DeviceMesh | None,
          placements: Sequence[Placement] | None, what: str) -> DTensor:
    mesh = _require_mesh(device_mesh, what)
    shape = _size(size)
    pl = normalize_placements(placements if placements is not None else
                              (REPLICATE,) * mesh.ndim, mesh.ndim, len(shape),
                              f"{what} placements")
    if any(type(p) is Partial for p in pl):
        raise ValueError(f"{what}: factories take Shard/Replicate placements, got {pl}")
    spec = DTensorSpec(mesh, pl, torch.Size(shape))
    local_shape, _ = spec.local_shape_and_offset()
    dtype = dtype or torch.get_default_dtype()
    device = get_platform().device()
    local = fill(local_shape, spec, dtype, device)
    return _wrap(local.requires_grad_(requires_grad), spec)


def zeros(*size: Any, requires_grad: bool = False, dtype: torch.dtype | None = None,
          layout: Any = None, device_mesh: DeviceMesh | None = None,
          placements: Sequence[Placement] | None = None) -> DTensor:
    return _make(size, lambda s, sp, dt, dv: torch.zeros(s, dtype=dt, device=dv), dtype=dtype,
                 requires_grad=requires_grad, device_mesh=device_mesh, placements=placements,
                 what="zeros")


def ones(*size: Any, requires_grad: bool = False, dtype: torch.dtype | None = None,
         layout: Any = None, device_mesh: DeviceMesh | None = None,
         placements: Sequence[Placement] | None = None) -> DTensor:
    return _make(size, lambda s, sp, dt, dv: torch.ones(s, dtype=dt, device=dv), dtype=dtype,
                 requires_grad=requires_grad, device_mesh=device_mesh, placements=placements,
                 what="ones")


def empty(*size: Any, requires_grad: bool = False, dtype: torch.dtype | None = None,
          layout: Any = None, device_mesh: DeviceMesh | None = None,
          placements: Sequence[Placement] | None = None) -> DTensor:
    return _make(size, lambda s, sp, dt, dv: torch.empty(s, dtype=dt, device=dv), dtype=dtype,
                 requires_grad=requires_grad, device_mesh=device_mesh, placements=placements,
                 what="empty")


def full(size: Sequence[int], fill_value: Any, *, requires_grad: bool = False,
         dtype: torch.dtype | None = None, layout: Any = None,
         device_mesh: DeviceMesh | None = None,
         placements: Sequence[Placement] | None = None) -> DTensor:
    return _make((tuple(size),),
                 lambda s, sp, dt, dv: torch.full(s, fill_value, dtype=dt, device=dv),
                 dtype=dtype, requires_grad=requires_grad, device_mesh=device_mesh,
                 placements=placements, what="full")


def _random_fill(block: Callable) -> Callable:
    def fill(local_shape: tuple, spec: DTensorSpec, dtype: torch.dtype, device: Any):
        _, offset = spec.local_shape_and_offset()
        return block(tuple(spec.shape), local_shape, offset, dtype, device)

    return fill


def rand(*size: Any, requires_grad: bool = False, dtype: torch.dtype | None = None,
         layout: Any = None, device_mesh: DeviceMesh | None = None,
         placements: Sequence[Placement] | None = None) -> DTensor:
    """Uniform [0, 1) values; equal to ``hyperpar.torch.dtensor.random.rand(size)`` sliced."""
    return _make(size, _random_fill(_random.uniform_block), dtype=dtype,
                 requires_grad=requires_grad, device_mesh=device_mesh, placements=placements,
                 what="rand")


def randn(*size: Any, requires_grad: bool = False, dtype: torch.dtype | None = None,
          layout: Any = None, device_mesh: DeviceMesh | None = None,
          placements: Sequence[Placement] | None = None) -> DTensor:
    """Standard normal values; equal to ``hyperpar.torch.dtensor.random.randn(size)`` sliced."""
    return _make(size, _random_fill(_random.normal_block), dtype=dtype,
                 requires_grad=requires_grad, device_mesh=device_mesh, placements=placements,
                 what="randn")
