"""Ops that read some dims whole and act on each slice of the others alone, and the gathered
fallback.

* ``local_dims`` (``flip``, ``roll``, ``tril``/``triu``, ``cummax``/``cummin``,
  ``logcumsumexp``, ``softmin``, ...): one tensor input; the op is local wherever the dims it
  reads (``dims``) are not sharded, so the shards on those dims are gathered, the others kept,
  and every output has the input's shape and the resulting placements. Partial inputs are
  reduced first (the ops are not linear, or not in the pending sum's sense: ``cummax``).
* ``gathered``: every input Replicate, the op run whole on every rank, every output Replicate.
  Right for any op whose result is deterministic (the same on every rank); the platform passes
  the output ``shapes`` (it knows the op). The slow, always-correct layout for ops whose
  sharded semantics are not written (``addmm``, ``einsum``, the losses, ``diag``, ...).
"""

from __future__ import annotations

from typing import Any

from ..placement import REPLICATE
from .base import OpSharding, Shape, TensorMeta, norm_dim, rule, unshard


@rule("local_dims")
def _local_dims(op: str, metas: tuple[TensorMeta, ...], mesh_shape: tuple[int, ...], *,
                dims: Any = (), n_out: int = 1, shapes: tuple[Shape, ...] | None = None,
                **_: Any) -> OpSharding:
    (x,) = metas
    nd = len(x.shape)
    read = {norm_dim(d, nd) for d in dims} if nd else set()
    target = unshard(x.placements, read)
    if shapes is None:
        shapes = (tuple(x.shape),) * n_out
    for s in shapes:  # a kept shard must be on a dim the op leaves as it is
        for p in target:
            if p.is_shard() and (len(s) != nd or s[p.dim] != x.shape[p.dim]):
                raise ValueError(f"{op}: output shape {tuple(s)} resizes sharded dim {p.dim} "
                                 f"of input shape {tuple(x.shape)}; list it in dims")
    return OpSharding((target,), (target,) * n_out, tuple(tuple(s) for s in shapes))


@rule("gathered")
def _gathered(op: str, metas: tuple[TensorMeta, ...], mesh_shape: tuple[int, ...], *,
              shapes: tuple[Shape, ...] = (), **_: Any) -> OpSharding:
    rep = (REPLICATE,) * len(mesh_shape)
    return OpSharding(tuple(rep for _ in metas), tuple(rep for _ in shapes), tuple(shapes))
