"""Offset-based random numbers for DTensors, identical on every backend (the host backend included).

Every random value is a pure function of ``(seed, offset, global element index)`` -- a
counter-based generator (splitmix64 finaliser, in int64 tensor ops) -- so a rank that holds
elements ``[a, b)`` of a sharded tensor computes exactly the values the full tensor would get in
one process. Each random call advances the shared offset by the global element count, so ranks
stay in step as long as they make the same sequence of calls (they do: DTensor ops are SPMD).

The same functions work on plain tensors (``rand``, ``randn``, ``dropout`` below), which is how
a single-process reference reproduces a sharded run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from hyperpar.platform import get_platform

_G = 0x9E3779B97F4A7C15 - (1 << 64)
_M1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_M2 = 0x94D049BB133111EB - (1 << 64)


class _State:
    seed: int | None = None
    offset: int = 0


_STATE = _State()


def manual_seed(seed: int) -> None:
    """Seed the DTensor generator (call it with the same seed on every rank)."""
    _STATE.seed = int(seed) & ((1 << 62) - 1)
    _STATE.offset = 0


def _seed() -> int:
    if _STATE.seed is None:
        seed = torch.initial_seed()
        platform = get_platform()
        if platform.is_initialized() and platform.world_size() > 1:
            seed = platform.broadcast_object(seed, 0)  # every rank must agree
        manual_seed(seed)
    return _STATE.seed  # type: ignore[return-value]


def _advance(numel: int) -> tuple[int, int]:
    seed = _seed()
    offset = _STATE.offset
    _STATE.offset += numel
    return seed, offset


def _srl(x: torch.Tensor, k: int) -> torch.Tensor:
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _srl(z, 30)) * _M1
    z = (z ^ _srl(z, 27)) * _M2
    return z ^ _srl(z, 31)


def _indices(global_shape: Sequence[int], local_shape: Sequence[int], offset: Sequence[int],
             device: torch.device) -> torch.Tensor:
    """Global row-major index of every local element."""
    idx = torch.zeros((), dtype=torch.int64, device=device)
    stride = 1
    for d in reversed(range(len(global_shape))):
        ar = torch.arange(offset[d], offset[d] + local_shape[d], dtype=torch.int64,
                          device=device) * stride
        idx = idx + ar.view([-1] + [1] * (len(global_shape) - 1 - d))
        stride *= int(global_shape[d])
    return idx.expand(tuple(local_shape)) if idx.ndim < len(local_shape) else idx


def _uniform(idx: torch.Tensor, seed: int, offset: int, dtype: torch.dtype) -> torch.Tensor:
    key = _mix(torch.tensor(seed, dtype=torch.int64, device=idx.device))
    z = _mix((idx + offset) * _G + key)
    if dtype == torch.float64:
        return _srl(z, 11).to(dtype) * (1.0 / (1 << 53))
    return (_srl(z, 40).to(torch.float32) * (1.0 / (1 << 24))).to(dtype)


def uniform_block(global_shape: Sequence[int], local_shape: Sequence[int],
                  offset: Sequence[int], dtype: torch.dtype, device: torch.device
                  ) -> torch.Tensor:
    """Uniform [0, 1) values of the block ``offset + local_shape`` of a ``global_shape``
    tensor; advances the generator by the global element count."""
    seed, off = _advance(math.prod(global_shape))
    idx = _indices(global_shape, local_shape, offset, device)
    return _uniform(idx, seed, off, dtype)


def normal_block(global_shape: Sequence[int], local_shape: Sequence[int],
                 offset: Sequence[int], dtype: torch.dtype, device: torch.device
                 ) -> torch.Tensor:
    """Standard normal values (Box-Muller on two counter streams) of one block."""
    n = math.prod(global_shape)
    seed, off = _advance(2 * n)
    idx = _indices(global_shape, local_shape, offset, device)
    u1 = 1.0 - _uniform(idx, seed, off, torch.float64)  # (0, 1]
    u2 = _uniform(idx, seed, off + n, torch.float64)
    return (torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2 * math.pi * u2)).to(dtype)


def rand(*size: int, dtype: torch.dtype | None = None,
         device: torch.device | None = None) -> torch.Tensor:
    """A plain tensor of uniform values, equal to the DTensor factory's ``full_tensor()``."""
    shape = tuple(size[0]) if len(size) == 1 and not isinstance(size[0], int) else size
    return uniform_block(shape, shape, (0,) * len(shape), dtype or torch.get_default_dtype(),
                         device or get_platform().device())


def randn(*size: int, dtype: torch.dtype | None = None,
          device: torch.device | None = None) -> torch.Tensor:
    """A plain tensor of normal values, equal to the DTensor factory's ``full_tensor()``."""
    shape = tuple(size[0]) if len(size) == 1 and not isinstance(size[0], int) else size
    return normal_block(shape, shape, (0,) * len(shape), dtype or torch.get_default_dtype(),
                        device or get_platform().device())


def dropout(x: torch.Tensor, p: float = 0.5, training: bool = True) -> torch.Tensor:
    """Dropout of a plain tensor with the DTensor generator (the single-process reference of
    ``F.dropout`` on a DTensor)."""
    if not training or p == 0.0:
        return x
    keep = uniform_block(x.shape, x.shape, (0,) * x.ndim, torch.float32, x.device) >= p
    return x * keep.to(x.dtype) / (1.0 - p)
