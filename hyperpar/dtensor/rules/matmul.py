"""Contractions (``matmul``, ``bmm``, ``linear``) as einsums over labelled dims: per mesh dim
the cheapest of sharding a kept label (output sharded), sharding a contracted label (output
``Partial("sum")``), keeping one Partial operand with the others replicated, or replicating."""

from __future__ import annotations

import math
import string
from typing import Any

from ..placement import REPLICATE, Partial, Placement, Replicate, Shard
from .base import P_SUM, OpSharding, Placements, Shape, TensorMeta, no_rule, rule
from .elementwise import broadcast_shapes

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


def _batch_labels(a: Shape, b: Shape) -> tuple[str, str, str, str, Shape]:
    """Labels of the batch dims of ``a`` and ``b`` (all but the last two), the output's and the
    blocked ones (size-1 dims broadcast against a larger one)."""
    ba, bb = a[:-2], b[:-2]
    out = broadcast_shapes(ba, bb)
    letters = string.ascii_lowercase[:len(out)]  # 'm', 'k', 'n' come after the batch letters
    la = "".join(letters[len(out) - len(ba):])
    lb = "".join(letters[len(out) - len(bb):])
    blocked = "".join(letters[i] for i in range(len(out))
                      if any(len(s) >= len(out) - i and s[i - len(out)] != out[i]
                             for s in (ba, bb)))
    return la, lb, letters, blocked, out


@rule("matmul", "bmm")
def _matmul(op: str, metas: tuple[TensorMeta, ...], mesh_shape: tuple[int, ...],
            **_: Any) -> OpSharding:
    a, b = metas
    if len(a.shape) < 2 or len(b.shape) < 2:
        raise no_rule(op, metas, "matrix-vector products have no rule yet (unsqueeze the "
                                 "vector)")
    la, lb, lout, blocked, batch = _batch_labels(a.shape, b.shape)
    if len(lout) > 20:
        raise no_rule(op, metas, "too many batch dims")
    targets, outs = contraction([(a.placements, la + "xy", a.shape),
                                 (b.placements, lb + "yz", b.shape)], lout + "xz",
                                len(mesh_shape), blocked)
    shape = (*batch, a.shape[-2], b.shape[-1])
    return OpSharding(tuple(targets), (outs,), (shape,))


@rule("linear")
def _linear(op: str, metas: tuple[TensorMeta, ...], mesh_shape: tuple[int, ...],
            **_: Any) -> OpSharding:
    """``x @ w.T + b``: x (..., k), w (n, k), optional bias (n,)."""
    x, w = metas[0], metas[1]
    batch = "abcdefgh"[:len(x.shape) - 1]
    targets, outs = contraction([(x.placements, batch + "k", x.shape),
                                 (w.placements, "nk", w.shape)], batch + "n", len(mesh_shape))
    if len(metas) > 2:  # the bias follows the output: sharded with it, or added once if Partial
        bias = tuple(Shard(0) if o == Shard(len(batch)) else P_SUM if o == P_SUM else R
                     for o in outs)
        targets.append(bias)
    return OpSharding(tuple(targets), (outs,), ((*x.shape[:-1], w.shape[0]),))


__all__ = ["Partial", "contraction"]
