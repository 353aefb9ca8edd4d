"""Where a layout puts a whole numpy array's values, written independently of hyperpar
(``torch.chunk``'s rule), so the tests compare hyperpar with numpy, never with itself."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from hyperpar import Partial, Shard


def piece(full: np.ndarray, placements: Sequence[Any], mesh_shape: Sequence[int],
          coord: Sequence[int]) -> np.ndarray:
    """The ``torch.chunk`` piece of ``full`` at mesh coordinate ``coord`` (pieces of
    ``ceil(size / n)``, the tail shorter: 7 rows over 4 ranks are 2, 2, 2, 1)."""
    out = full
    for m, p in enumerate(placements):
        if isinstance(p, Shard):
            dim = p.dim % full.ndim
            n, size = mesh_shape[m], out.shape[dim]
            step = -(-size // n)
            start = min(coord[m] * step, size)
            out = np.take(out, range(start, min(start + step, size)), axis=dim)
    return out


def terms(full: np.ndarray, placements: Sequence[Any], mesh_shape: Sequence[int],
          coord: Sequence[int], seed: int) -> np.ndarray:
    """This rank's term of ``full`` under ``Partial("sum")`` mesh dims: integer-valued random
    terms that sum to ``full`` exactly (rank 0 of each Partial dim keeps the remainder)."""
    local = full
    for m, p in enumerate(placements):
        if isinstance(p, Partial):
            rng = np.random.default_rng(seed + 100 * m)
            extra = rng.integers(-3, 4, (mesh_shape[m], *local.shape)).astype(np.float32)
            extra[0] = 0
            extra[0] = local - extra.sum(0)
            local = extra[coord[m]]
    return local


def close(what: str, got: np.ndarray, want: np.ndarray, rtol: float) -> None:
    """``|got - want| <= rtol * max(1, max |want|)`` elementwise, with a message naming ``what``."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape}"
    if not got.size:
        return
    scale = max(1.0, float(np.max(np.abs(want))))
    diff = float(np.max(np.abs(got.astype(np.float64) - want)))
    assert diff <= rtol * scale, f"{what}: max |diff| {diff:.3e} > {rtol * scale:.3e}"
