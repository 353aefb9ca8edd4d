"""Normalisation: ``layer_norm`` and ``rms_norm`` (over the trailing ``normalized_shape``) and
``group_norm`` (over every dim but the batch, dim 0).

Inputs: the tensor first, then whichever of weight and bias are DTensors. The normalised dims
(and any Partial) are gathered, other shards stay; weight and bias are replicated (their
gradient is summed where the output is sharded). ``stats``: how many per-row statistics the
framework's op also returns after the output (MindSpore's ``LayerNorm``: mean and variance,
``GroupNorm``: mean and 1/std; torch returns none): shaped as the input with the normalised
dims kept as 1 (``layer_norm``/``rms_norm``) or ``(N, num_groups)`` (``group_norm``), laid out
like the output."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..placement import REPLICATE
from .base import OpSharding, Shape, TensorMeta, rule, unshard


def _answer(metas: tuple[TensorMeta, ...], mesh_shape: tuple[int, ...], dims: range,
            stats: int, stats_shape: Shape) -> OpSharding:
    x = metas[0]
    pl = unshard(x.placements, dims)
    params = ((REPLICATE,) * len(mesh_shape),) * (len(metas) - 1)
    return OpSharding((pl, *params), (pl,) * (1 + stats),
                      (tuple(x.shape),) + (stats_shape,) * stats)


@rule("layer_norm", "rms_norm")
def _trailing_norm(op: str, metas: tuple[TensorMeta, ...], mesh_shape: tuple[int, ...], *,
                   normalized_shape: int | Sequence[int], stats: int = 0,
                   **_: Any) -> OpSharding:
    """Normalised over the last ``len(normalized_shape)`` dims (the framework's op checks that
    they match)."""
    nd = len(metas[0].shape)
    n = 1 if isinstance(normalized_shape, int) else len(normalized_shape)
    dims = range(max(nd - n, 0), nd)
    stats_shape = tuple(1 if d in dims else s for d, s in enumerate(metas[0].shape))
    return _answer(metas, mesh_shape, dims, stats, stats_shape)


@rule("group_norm")
def _group_norm(op: str, metas: tuple[TensorMeta, ...], mesh_shape: tuple[int, ...], *,
                num_groups: int = 1, stats: int = 0, **_: Any) -> OpSharding:
    """Normalised over every dim but the batch (dim 0): only a batch shard stays."""
    x = metas[0]
    nd = len(x.shape)
    stats_shape = (x.shape[0], num_groups) if nd else ()
    return _answer(metas, mesh_shape, range(1, nd), stats, stats_shape)
