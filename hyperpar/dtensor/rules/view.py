"""Views: ``reshape`` (``view``, flatten, squeeze, ...), ``transpose``, ``permute``. Partial
placements pass through (views are linear)."""

from __future__ import annotations

import math
from typing import Any

from ..placement import REPLICATE, Placement, Shard
from .base import OpSharding, Shape, TensorMeta, no_rule, norm_dim, rule


def infer_shape(numel: int, shape: Any) -> Shape:
    """``shape`` with its ``-1`` resolved for a tensor of ``numel`` elements."""
    shape = tuple(int(s) for s in shape)
    if shape.count(-1) > 1:
        raise ValueError(f"reshape: only one dim may be -1, got {shape}")
    if -1 in shape:
        rest = math.prod(s for s in shape if s != -1)
        if rest == 0 or numel % rest:
            raise ValueError(f"reshape: cannot view {numel} elements as {shape}")
        shape = tuple(numel // rest if s == -1 else s for s in shape)
    if math.prod(shape) != numel:
        raise ValueError(f"reshape: cannot view {numel} elements as {shape}")
    return shape


def _blocks(src: Shape, dst: Shape) -> list[tuple[list[int], list[int]]]:
    """Groups of consecutive dims of ``src`` and ``dst`` with equal products."""
    out, i, j = [], 0, 0
    while i < len(src) or j < len(dst):
        a, b = [i], [j] if j < len(dst) else []
        pa = src[i] if i < len(src) else 1
        pb = dst[j] if j < len(dst) else 1
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb and i < len(src):
                pa *= src[i]
                a.append(i)
                i += 1
            elif j < len(dst):
                pb *= dst[j]
                b.append(j)
                j += 1
            else:
                break
        out.append(([d for d in a if d < len(src)], [d for d in b if d < len(dst)]))
    return out


@rule("reshape")
def _reshape(op: str, metas: tuple[TensorMeta, ...], mesh_shape: tuple[int, ...], *,
             shape: Any, **_: Any) -> OpSharding:
    """A shard of dim ``d`` survives when ``d`` maps onto an output dim of the same size, or
    leads its group of merged/split dims and both ``d`` and the dim it becomes divide evenly
    over the ranks sharding it; else it is gathered first."""
    (x,) = metas
    out_shape = infer_shape(math.prod(x.shape), shape)
    lead = {}
    same = set()  # dims that map one-to-one onto an output dim of the same size
    for a, b in _blocks(tuple(x.shape), out_shape):
        if a and b:
            lead[a[0]] = b[0]
            if len(a) == 1 and len(b) == 1:
                same.add(a[0])
    ways: dict[int, int] = {}
    for m, p in enumerate(x.placements):
        if type(p) is Shard:
            ways[p.dim] = ways.get(p.dim, 1) * mesh_shape[m]
    target: list[Placement] = []
    outs: list[Placement] = []
    for p in x.placements:
        if type(p) is Shard:
            e = lead.get(p.dim)
            n = ways[p.dim]
            # A dim kept whole (same size, not merged or split) keeps torch.chunk's pieces
            # however uneven: (B, S, V) -> (B * S, V) keeps a vocabulary of 11 over 4 sharded.
            even = x.shape[p.dim] % n == 0 and out_shape[e] % n == 0 if e is not None else False
            if e is not None and (p.dim in same or even):
                target.append(p)
                outs.append(Shard(e))
            else:
                target.append(REPLICATE)
                outs.append(REPLICATE)
        else:
            target.append(p)
            outs.append(p)
    if tuple(target) != tuple(x.placements) and any(type(p) is Shard for p in target):
        # gathering one mesh dim changes the piece sizes the others saw: replicate every
        # mesh dim that shards a dim we had to gather (simple and always exact)
        gathered = {p.dim for p, t in zip(x.placements, target, strict=True)
                    if type(p) is Shard and type(t) is not Shard}
        target = [REPLICATE if type(p) is Shard and p.dim in gathered else t
                  for p, t in zip(x.placements, target, strict=True)]
        outs = [REPLICATE if type(p) is Shard and p.dim in gathered else o
                for p, o in zip(x.placements, outs, strict=True)]
    return OpSharding((tuple(target),), (tuple(outs),), (out_shape,))


def _permuted(op: str, x: TensorMeta, perm: tuple[int, ...]) -> OpSharding:
    if sorted(perm) != list(range(len(x.shape))):
        raise no_rule(op, (x,), f"{perm} is not a permutation of the dims")
    pl = tuple(Shard(perm.index(p.dim)) if type(p) is Shard else p for p in x.placements)
    return OpSharding((tuple(x.placements),), (pl,), (tuple(x.shape[d] for d in perm),))


@rule("transpose")
def _transpose(op: str, metas: tuple[TensorMeta, ...], mesh_shape: tuple[int, ...], *,
               dim0: int, dim1: int, **_: Any) -> OpSharding:
    (x,) = metas
    nd = len(x.shape)
    perm = list(range(nd))
    a, b = norm_dim(dim0, nd), norm_dim(dim1, nd)
    perm[a], perm[b] = perm[b], perm[a]
    return _permuted(op, x, tuple(perm))


@rule("permute")
def _permute(op: str, metas: tuple[TensorMeta, ...], mesh_shape: tuple[int, ...], *,
             dims: Any, **_: Any) -> OpSharding:
    (x,) = metas
    return _permuted(op, x, tuple(norm_dim(d, len(x.shape)) for d in dims))
