"""Elementwise ops: broadcasting placements and the Partial algebra.

The output is sharded where any input shards a non-broadcast dim; the other inputs follow
(broadcast dims stay replicated). ``Partial``: ``add``/``sub`` of partials of one kind stay
partial, ``mul``/``div`` by a replicated factor keep ``Partial("sum")``, anything else reduces
first. Neutral names: ``add``, ``sub``, ``neg``, ``identity`` (copies, casts: linear), ``mul``,
``div``, ``elementwise`` (anything nonlinear: exp, relu, compare, ...).
"""

from __future__ import annotations

from typing import Any

from ..placement import REPLICATE, Partial, Placement, Shard
from .base import P_SUM, OpSharding, Placements, Shape, ShardingError, TensorMeta, rule

#: neutral op name -> the Partial algebra it follows
KIND = {"add": "linear", "sub": "linear", "neg": "linear", "identity": "linear", "mul": "mul",
        "div": "div", "elementwise": "other"}


def broadcast_shapes(*shapes: Shape) -> Shape:
    """numpy/torch broadcasting of ``shapes`` (pure Python)."""
    nd = 0
    for s in shapes:  # a loop, not max(genexpr, default=): Dynamo traces this under compile
        nd = max(nd, len(s))
    out = [1] * nd
    for s in shapes:
        for i, size in enumerate(s, start=nd - len(s)):
            if size != 1:
                if out[i] not in (1, size):
                    raise ValueError(f"shapes {[tuple(x) for x in shapes]} do not broadcast")
                out[i] = size
    return tuple(out)


def elementwise_plan(kind: str, inplace: bool, metas: tuple, first_is_arg0: bool,
                     mesh_ndim: int, has_scalar: bool = False
                     ) -> tuple[tuple[Placements, ...], Placements, Shape]:
    """(target placements per input, output placements, output shape) of an elementwise op of
    ``kind`` (``linear``, ``mul``, ``div``, ``other``); ``metas`` are ``(placements, shape)``."""
    shapes = [tuple(m[1]) for m in metas]
    out_shape = broadcast_shapes(*shapes) if not inplace else shapes[0]
    nd = len(out_shape)
    targets: list[list[Placement]] = [[] for _ in metas]
    outs: list[Placement] = []
    for m in range(mesh_ndim):
        cur = [meta[0][m] for meta in metas]
        out: Placement | None = None
        if inplace:
            out = cur[0]
        else:
            for k, p in enumerate(cur):
                if type(p) is Shard:
                    d_out = p.dim + nd - len(shapes[k])
                    if shapes[k][p.dim] == out_shape[d_out]:
                        out = Shard(d_out)
                        break
        if out is None or type(out) is Partial:
            partial_out = partial_result(kind, cur, first_is_arg0, has_scalar)
            if type(out) is Partial and partial_out != out:
                raise ShardingError(
                    f"in-place {kind} op on a Partial({out.reduce_op!r}) tensor with inputs "
                    f"{cur} would not keep it Partial; redistribute it to Replicate first")
            out = partial_out
        outs.append(out)
        for k, p in enumerate(cur):
            if type(out) is Shard:
                dk = out.dim - (nd - len(shapes[k]))
                if dk >= 0 and shapes[k][dk] == out_shape[out.dim]:
                    targets[k].append(Shard(dk))
                else:
                    targets[k].append(REPLICATE)
            elif type(out) is Partial:
                if type(p) is Partial:
                    targets[k].append(p)
                elif out.reduce_op == "sum" and kind == "linear":
                    targets[k].append(P_SUM)
                else:
                    targets[k].append(REPLICATE)
            else:
                targets[k].append(REPLICATE)
    tg = tuple(tuple(t) for t in targets)
    if inplace and tg[0] != tuple(metas[0][0]):
        raise ShardingError(
            f"in-place op would need to change the placements of its output {metas[0][0]}")
    return tg, tuple(outs), out_shape


def partial_result(kind: str, cur: list[Placement], first_is_arg0: bool,
                   has_scalar: bool = False) -> Placement:
    """The output placement on one mesh dim where no input shards a kept dim."""
    partials = [p for p in cur if type(p) is Partial]
    if not partials:
        return REPLICATE
    if kind == "linear":
        ops = {p.reduce_op for p in partials}
        # x + c on a Partial("sum") would add c once per rank: only "avg" absorbs a constant
        if len(ops) == 1 and next(iter(ops)) in (("avg",) if has_scalar else ("sum", "avg")):
            return partials[0]
    elif kind in ("mul", "div") and len(partials) == 1 and partials[0] == P_SUM:
        if kind == "mul" or (first_is_arg0 and type(cur[0]) is Partial):
            return P_SUM
    return REPLICATE


@rule(*KIND)
def _elementwise(op: str, metas: tuple[TensorMeta, ...], mesh_shape: tuple[int, ...], *,
                 has_scalar: bool = False, first_is_tensor: bool = True,
                 **_: Any) -> OpSharding:
    targets, outs, shape = elementwise_plan(
        KIND[op], False, tuple((m.placements, m.shape) for m in metas), first_is_tensor,
        len(mesh_shape), has_scalar)
    return OpSharding(targets, (outs,), (shape,))
