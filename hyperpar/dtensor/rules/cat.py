"""Joining and splitting along a dim: ``cat``, ``stack``, ``split`` (every split/chunk variant,
given the output sizes), ``unbind``. Each piece of a shard along another dim lines up with the
others', so those shards stay; the joined or split dim itself is gathered. Partial inputs stay
Partial where all agree (the ops are linear)."""

from __future__ import annotations

from typing import Any

from ..placement import REPLICATE, Partial, Placement, Shard
from .base import OpSharding, TensorMeta, no_rule, norm_dim, rule


def _common(metas: tuple[TensorMeta, ...], dim: int | None) -> tuple[Placement, ...]:
    """The one layout every input takes: the first input's, with ``dim`` gathered and a Partial
    that not every input shares reduced."""
    out: list[Placement] = []
    for m, p in enumerate(metas[0].placements):
        if type(p) is Shard and p.dim == dim:
            p = REPLICATE
        elif type(p) is Partial and any(t.placements[m] != p for t in metas):
            p = REPLICATE
        out.append(p)
    return tuple(out)


def _check_same(op: str, metas: tuple[TensorMeta, ...], skip: int | None) -> None:
    first = metas[0].shape
    for t in metas:
        if len(t.shape) != len(first) or any(
                a != b for d, (a, b) in enumerate(zip(t.shape, first, strict=True)) if d != skip):
            raise no_rule(op, metas, "the inputs' shapes must match"
                          + (f" except along dim {skip}" if skip is not None else ""))


@rule("cat")
def _cat(op: str, metas: tuple[TensorMeta, ...], mesh_shape: tuple[int, ...], *,
         dim: int = 0, **_: Any) -> OpSharding:
    """Every input takes the first one's layout with the cat dim gathered."""
    if not metas:
        raise no_rule(op, metas, "cat needs at least one tensor")
    d = norm_dim(dim, len(metas[0].shape))
    _check_same(op, metas, d)
    pl = _common(metas, d)
    shape = list(metas[0].shape)
    shape[d] = sum(t.shape[d] for t in metas)
    return OpSharding((pl,) * len(metas), (pl,), (tuple(shape),))


@rule("stack")
def _stack(op: str, metas: tuple[TensorMeta, ...], mesh_shape: tuple[int, ...], *,
           dim: int = 0, **_: Any) -> OpSharding:
    """Every input takes the first one's layout; shards move past the new dim. No gather."""
    if not metas:
        raise no_rule(op, metas, "stack needs at least one tensor")
    nd = len(metas[0].shape)
    d = norm_dim(dim, nd + 1)
    _check_same(op, metas, None)
    pl = _common(metas, None)
    out = tuple(Shard(p.dim + (p.dim >= d)) if type(p) is Shard else p for p in pl)
    shape = (*metas[0].shape[:d], len(metas), *metas[0].shape[d:])
    return OpSharding((pl,) * len(metas), (out,), (shape,))


@rule("split")
def _split(op: str, metas: tuple[TensorMeta, ...], mesh_shape: tuple[int, ...], *,
           dim: int = 0, sizes: Any, **_: Any) -> OpSharding:
    """Pieces of ``sizes`` along ``dim`` (every split/chunk variant, normalised by the
    platform into the sizes it produces): that dim gathered, other shards kept."""
    (x,) = metas
    d = norm_dim(dim, len(x.shape))
    sizes = tuple(int(s) for s in sizes)
    if sum(sizes) != x.shape[d] or any(s < 0 for s in sizes):
        raise ValueError(f"split: sizes {list(sizes)} do not add up to dim {d}'s size "
                         f"{x.shape[d]}")
    pl = tuple(REPLICATE if type(p) is Shard and p.dim == d else p for p in x.placements)
    shapes = tuple((*x.shape[:d], s, *x.shape[d + 1:]) for s in sizes)
    return OpSharding((pl,), (pl,) * len(sizes), shapes)


@rule("unbind")
def _unbind(op: str, metas: tuple[TensorMeta, ...], mesh_shape: tuple[int, ...], *,
            dim: int = 0, **_: Any) -> OpSharding:
    """One output per index along ``dim``, without that dim: it is gathered, other shards
    kept (past ``dim`` they move one down)."""
    (x,) = metas
    d = norm_dim(dim, len(x.shape))
    pl = tuple(REPLICATE if type(p) is Shard and p.dim == d else p for p in x.placements)
    out = tuple(Shard(p.dim - (p.dim > d)) if type(p) is Shard else p for p in pl)
    shape = (*x.shape[:d], *x.shape[d + 1:])
    return OpSharding((pl,), (out,) * x.shape[d], (shape,) * x.shape[d])
