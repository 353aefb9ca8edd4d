"""Lookups and losses: ``embedding`` (weight, indices), ``gather_d`` (input, index along a dim)
and ``cross_entropy`` (logits, class targets, optional class weight). These are the one
decision of every framework: a vocabulary-parallel lookup and a mean loss over a sharded batch
come with a neutral description of their local computation (``OpSharding.local``)."""

from __future__ import annotations

from typing import Any

from ..layout import some_rank_empty
from ..placement import REPLICATE, Placement, Shard
from .base import (
    P_SUM,
    GlobalMean,
    MaskedLookup,
    OpSharding,
    TensorMeta,
    no_rule,
    norm_dim,
    rule,
)


@rule("embedding")
def _embedding(op: str, metas: tuple[TensorMeta, ...], mesh_shape: tuple[int, ...], *,
               padding_idx: int | None = None, **_: Any) -> OpSharding:
    """``embedding(weight (V, D), ids)``, per mesh dim: a table sharded along the embedding dim
    (Shard(1)) shards the output's last dim (the ids replicated); a vocabulary-sharded table
    (Shard(0)) with unsharded ids is a masked lookup of this rank's rows, giving a
    Partial("sum") output (``local`` is a :class:`MaskedLookup`; where some rank would hold no
    rows, the table is gathered instead); else sharded ids shard the
    output (the table replicated), and anything else is replicated."""
    w, ids = metas
    vocab = w.shape[0]
    if padding_idx is not None:
        if not -vocab <= padding_idx < vocab:
            raise ValueError(f"embedding: padding_idx {padding_idx} is outside the table's "
                             f"{vocab} rows; pass an index in [-{vocab}, {vocab})")
        padding_idx %= vocab
    nd_out = len(ids.shape) + 1
    rows = tuple(pw if pw == Shard(0) and type(pi) is not Shard else REPLICATE
                 for pw, pi in zip(w.placements, ids.placements, strict=True))
    # a rank without rows would look up in an empty table: gather the table there instead
    masked = not some_rank_empty((vocab,), rows, mesh_shape)
    tw: list[Placement] = []
    ti: list[Placement] = []
    outs: list[Placement] = []
    vocab_dims: list[int] = []
    for m, (pw, pi) in enumerate(zip(w.placements, ids.placements, strict=True)):
        if type(pw) is Shard and pw.dim == 1:
            tw.append(pw)
            ti.append(REPLICATE)
            outs.append(Shard(nd_out - 1))
        elif masked and rows[m] != REPLICATE:
            tw.append(pw)
            ti.append(REPLICATE)
            outs.append(P_SUM)
            vocab_dims.append(m)
        else:
            s = pi if type(pi) is Shard else REPLICATE
            tw.append(REPLICATE)
            ti.append(s)
            outs.append(s)
    local = MaskedLookup(tuple(vocab_dims), tuple(tw), vocab, padding_idx) \
        if vocab_dims else None
    return OpSharding((tuple(tw), tuple(ti)), (tuple(outs),), ((*ids.shape, w.shape[1]),),
                      local=local)


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
                   reduction: str = "mean", ignore_index: int = -100, **_: Any) -> OpSharding:
    """``cross_entropy`` / ``nll_loss`` on logits ``(N, C, d...)`` or ``(C,)``, class targets
    ``(N, d...)`` (or class probabilities shaped as the logits) and an optional class weight
    ``(C,)`` (a third input, replicated). Logits sharded off the class dim keep that shard (the
    target follows); the class dim is gathered. ``reduction="none"`` gives sharded per-sample
    losses; ``"sum"`` a Partial("sum") over the sharded mesh dims; ``"mean"`` too, as a local
    sum over the global count: of non-ignored class targets (class-weighted), all-reduced
    (``local`` is a :class:`GlobalMean`), or of samples for probability targets (a
    :class:`GlobalMean` with its ``count`` known)."""
    logits, target = metas[0], metas[1]
    if reduction not in ("mean", "sum", "none"):
        raise no_rule(op, metas, f"unknown reduction {reduction!r}")
    nd = len(logits.shape)
    class_dim = 1 if nd > 1 else 0
    probs = len(target.shape) == nd
    tl: list[Placement] = []
    tt: list[Placement] = []
    for p in logits.placements:
        if type(p) is Shard and p.dim != class_dim:
            tl.append(p)
            tt.append(p if probs or p.dim == 0 else Shard(p.dim - 1))
        else:
            tl.append(REPLICATE)
            tt.append(REPLICATE)
    inputs = (tuple(tl), tuple(tt)) + ((REPLICATE,) * len(mesh_shape),) * (len(metas) - 2)
    if reduction == "none":
        return OpSharding(inputs, (tuple(tt),), (tuple(target.shape),))
    sharded = tuple(m for m, p in enumerate(tl) if type(p) is Shard and mesh_shape[m] > 1)
    out = tuple(P_SUM if m in sharded else REPLICATE for m in range(len(mesh_shape)))
    if reduction == "sum" or not sharded:
        return OpSharding(inputs, (out,), ((),))
    if probs:
        count = 1
        for d, n in enumerate(logits.shape):
            count *= n if d != class_dim else 1
        return OpSharding(inputs, (out,), ((),), local=GlobalMean(sharded, count=count))
    return OpSharding(inputs, (out,), ((),),
                      local=GlobalMean(sharded, ignore_index, len(metas) > 2))
