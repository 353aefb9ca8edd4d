"""Lookups and losses: ``embedding`` (weight, indices), ``gather_d`` (input, index along a dim)
and ``cross_entropy`` (logits (N, C), class targets (N,))."""

from __future__ import annotations

from typing import Any

from ..placement import REPLICATE, Placement, Shard
from .base import P_SUM, OpSharding, TensorMeta, no_rule, norm_dim, rule


@rule("embedding")
def _embedding(op: str, metas: tuple[TensorMeta, ...], mesh_shape: tuple[int, ...],
               **_: Any) -> OpSharding:
    """Sharded indices give a sharded output (the table replicated); a table sharded along the
    embedding dim gives an output sharded along its last dim; a Partial table a Partial output.
    A vocabulary-sharded table is gathered (a masked lookup is the parallel styles' job)."""
    w, ids = metas
    nd_out = len(ids.shape) + 1
    tw: list[Placement] = []
    ti: list[Placement] = []
    outs: list[Placement] = []
    for pw, pi in zip(w.placements, ids.placements, strict=True):
        if type(pi) is Shard:
            tw.append(REPLICATE)
            ti.append(pi)
            outs.append(pi)
        elif type(pw) is Shard and pw.dim == 1:
            tw.append(pw)
            ti.append(REPLICATE)
            outs.append(Shard(nd_out - 1))
        elif pw == P_SUM:
            tw.append(pw)
            ti.append(REPLICATE)
            outs.append(P_SUM)
        else:
            tw.append(REPLICATE)
            ti.append(REPLICATE)
            outs.append(REPLICATE)
    return OpSharding((tuple(tw), tuple(ti)), (tuple(outs),), ((*ids.shape, w.shape[1]),))


@rule("gather_d")
def _gather_d(op: str, metas: tuple[TensorMeta, ...], mesh_shape: tuple[int, ...], *,
              dim: int, **_: Any) -> OpSharding:
    """``out[i][j] = x[i][index[i][j]]`` along ``dim``: other dims shard together when input
    and index agree on them; ``dim`` itself is gathered."""
    x, index = metas
    d = norm_dim(dim, len(x.shape))
    tx: list[Placement] = []
    ti: list[Placement] = []
    outs: list[Placement] = []
    for px, pi in zip(x.placements, index.placements, strict=True):
        s = px if type(px) is Shard else pi if type(pi) is Shard else None
        if s is not None and s.dim != d and x.shape[s.dim] == index.shape[s.dim]:
            tx.append(s)
            ti.append(s)
            outs.append(s)
        elif px == P_SUM and type(pi) is not Shard:
            tx.append(px)
            ti.append(REPLICATE)
            outs.append(P_SUM)
        else:
            tx.append(REPLICATE)
            ti.append(REPLICATE)
            outs.append(REPLICATE)
    return OpSharding((tuple(tx), tuple(ti)), (tuple(outs),), (tuple(index.shape),))


@rule("cross_entropy")
def _cross_entropy(op: str, metas: tuple[TensorMeta, ...], mesh_shape: tuple[int, ...], *,
                   reduction: str = "mean", **_: Any) -> OpSharding:
    """Batch-sharded logits and targets: per-sample losses stay sharded; their sum is
    Partial("sum"). A mean (its count excludes ignored targets, known only globally), sharded
    classes and Partial logits are gathered first (loss parallelism is the styles' job)."""
    logits, target = metas
    if len(logits.shape) != 2 or len(target.shape) != 1:
        raise no_rule(op, metas, "only (N, C) logits with (N,) class targets have a rule")
    if reduction not in ("mean", "sum", "none"):
        raise no_rule(op, metas, f"unknown reduction {reduction!r}")
    tl: list[Placement] = []
    tt: list[Placement] = []
    outs: list[Placement] = []
    for pl, pt in zip(logits.placements, target.placements, strict=True):
        batch = Shard(0) in (pl, pt)
        if batch and reduction != "mean":
            tl.append(Shard(0))
            tt.append(Shard(0))
            outs.append(Shard(0) if reduction == "none" else P_SUM)
        else:
            tl.append(REPLICATE)
            tt.append(REPLICATE)
            outs.append(REPLICATE)
    shape = (logits.shape[0],) if reduction == "none" else ()
    return OpSharding((tuple(tl), tuple(tt)), (tuple(outs),), (shape,))
