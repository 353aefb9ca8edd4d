"""Contractions (``matmul``, ``bmm``, ``linear``) as einsums over labelled dims: per mesh dim
the cheapest of sharding a kept label (output sharded), sharding a contracted label (output
``Partial("sum")``), keeping one Partial operand with the others replicated, or replicating."""

from __future__ import annotations

import math
from typing import Any

from ..placement import REPLICATE, Partial, Placement, Replicate, Shard
from .base import P_SUM, OpSharding, Placements, Shape, TensorMeta, no_rule, rule

R = REPLICATE


def _move_cost(cur: Placement, tgt: Placement, numel: int) -> float:
    """Rough bytes moved to turn ``cur`` into ``tgt`` (a local slice is nearly free)."""
    if cur == tgt:
        return 0.0
    if type(cur) is Replicate:
        return 0.01 * numel if type(tgt) is Shard else numel
    if type(cur) is Shard:
        return 0.5 * numel if type(tgt) is Shard else numel
    return (1.0 if type(tgt) is Shard else 2.0) * numel  # a pending reduction


def contraction(operands: list[tuple[Placements, str, Shape]], out: str, mesh_ndim: int,
                blocked: str = "") -> tuple[list[Placements], Placements]:
    """Target placements per operand and the output placements of the einsum given by each
    operand's labels and ``out``; ``blocked`` labels (broadcast dims) are never sharded."""
    labels = sorted({c for _, lab, _ in operands for c in lab} - set(blocked))
    numels = [max(1, math.prod(shape)) for _, _, shape in operands]
    targets: list[list[Placement]] = [[] for _ in operands]
    outs: list[Placement] = []
    for m in range(mesh_ndim):
        cur = [pl[m] for pl, _, _ in operands]
        cands: list[tuple[list[Placement], Placement]] = []
        for lab in labels:
            tg = [Shard(ls.index(lab)) if lab in ls else R for _, ls, _ in operands]
            cands.append((tg, Shard(out.index(lab)) if lab in out else P_SUM))
        for k in range(len(operands)):
            if cur[k] == P_SUM:
                cands.append(([P_SUM if j == k else R for j in range(len(operands))], P_SUM))
        cands.append(([R] * len(operands), R))
        # first candidate of least cost (a plain loop: Dynamo cannot trace min(key=), and the
        # torch stack's traced matmul rule runs this function)
        best, best_cost = cands[0], None
        for c in cands:
            cost = sum(_move_cost(cu, t, n) for cu, t, n in zip(cur, c[0], numels, strict=True))
            if best_cost is None or cost < best_cost:
                best, best_cost = c, cost
        for k, t in enumerate(best[0]):
            targets[k].append(t)
        outs.append(best[1])
    return [tuple(t) for t in targets], tuple(outs)


#: labels of the batch dims (at most 10); the matrix dims are 'm', 'k' (contracted) and 'n'
BATCH_LABELS = "abcdefghij"


def matmul_labels(a: Shape, b: Shape) -> tuple[str, str, str, str, Shape]:
    """``torch.matmul``'s dims as einsum labels: ``(a's, b's, the output's, blocked, output
    shape)``. A 1-D operand is a vector (its dim contracted, none in the output). Batch dims
    broadcast; where one side's is 1 and the other's larger, the size-1 side gets an upper-case
    label, which is ``blocked`` (never sharded), so the larger side may still be sharded there."""
    la = "k" if len(a) == 1 else "mk"
    lb = "k" if len(b) == 1 else "kn"
    ba, bb = a[:-2], b[:-2]
    nb = max(len(ba), len(bb))
    pa, pb, po, blocked = "", "", "", ""
    batch: list[int] = []
    for i in range(nb):
        da = ba[i - (nb - len(ba))] if i >= nb - len(ba) else None
        db = bb[i - (nb - len(bb))] if i >= nb - len(bb) else None
        lab = BATCH_LABELS[i]
        if da is not None and db is not None and da != db:
            blocked += lab.upper()
            pa += lab if da != 1 else lab.upper()
            pb += lab if db != 1 else lab.upper()
        else:
            pa += lab if da is not None else ""
            pb += lab if db is not None else ""
        po += lab
        batch.append(max(d for d in (da, db) if d is not None))
    out = po + ("m" if len(a) > 1 else "") + ("n" if len(b) > 1 else "")
    shape = (*batch, *a[-2:-1], *b[-1:]) if len(b) > 1 else (*batch, *a[-2:-1])
    return pa + la, pb + lb, out, blocked, shape


@rule("matmul", "bmm")
def _matmul(op: str, metas: tuple[TensorMeta, ...], mesh_shape: tuple[int, ...],
            **_: Any) -> OpSharding:
    """``torch.matmul``'s semantics (vectors, broadcast batch dims) as one einsum."""
    a, b = metas
    if not a.shape or not b.shape:
        raise no_rule(op, metas, "a 0-dim operand has no matrix product")
    if max(len(a.shape), len(b.shape)) - 2 > len(BATCH_LABELS):
        raise no_rule(op, metas, f"more than {len(BATCH_LABELS)} batch dims")
    la, lb, lout, blocked, shape = matmul_labels(a.shape, b.shape)
    targets, outs = contraction([(a.placements, la, a.shape), (b.placements, lb, b.shape)],
                                lout, len(mesh_shape), blocked)
    return OpSharding(tuple(targets), (outs,), (shape,))


@rule("linear")
def _linear(op: str, metas: tuple[TensorMeta, ...], mesh_shape: tuple[int, ...],
            **_: Any) -> OpSharding:
    """``x @ w.T + b``: x (..., k), w (n, k), optional bias (n,)."""
    x, w = metas[0], metas[1]
    if len(x.shape) - 1 > len(BATCH_LABELS):
        raise no_rule(op, metas, f"more than {len(BATCH_LABELS)} batch dims")
    batch = BATCH_LABELS[:len(x.shape) - 1]
    targets, outs = contraction([(x.placements, batch + "k", x.shape),
                                 (w.placements, "nk", w.shape)], batch + "n", len(mesh_shape))
    if len(metas) > 2:  # the bias follows the output: sharded with it, or added once if Partial
        bias = tuple(Shard(0) if o == Shard(len(batch)) else P_SUM if o == P_SUM else R
                     for o in outs)
        targets.append(bias)
    return OpSharding(tuple(targets), (outs,), ((*x.shape[:-1], w.shape[0]),))


__all__ = ["BATCH_LABELS", "Partial", "contraction", "matmul_labels"]
