"""Deterministic per-rank inputs: every process can rebuild any rank's tensor."""

from __future__ import annotations

import torch


def rank_tensor(rank: int, shape: tuple[int, ...], *, salt: int = 0,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A tensor that depends only on (rank, shape, salt): the same in every process."""
    gen = torch.Generator().manual_seed(1000 * salt + rank)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(-50, 50, shape, generator=gen, dtype=dtype)
