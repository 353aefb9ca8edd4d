"""Views: ``reshape`` (``view``, flatten, unflatten, squeeze, unsqueeze), ``transpose``,
``permute``. Partial placements pass through (views are linear)."""

from __future__ import annotations

import math
from typing import Any

from ..placement import REPLICATE, Shard
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


def flattened_shape(shape: Shape, start_dim: int = 0, end_dim: int = -1) -> Shape:
    """``shape`` after ``flatten(start_dim, end_dim)`` (a 0-d tensor becomes ``(1,)``); dims
    out of range raise torch's IndexError."""
    start, end = norm_dim(start_dim, len(shape)), norm_dim(end_dim, len(shape))
    if start > end:
        raise ValueError(f"flatten: start_dim {start_dim} cannot come after end_dim {end_dim} "
                         f"for a tensor of shape {tuple(shape)}")
    return (*shape[:start], math.prod(shape[start:end + 1]), *shape[end + 1:])


def unsqueezed_shape(shape: Shape, dim: int) -> Shape:
    """``shape`` after ``unsqueeze(dim)`` (``dim`` in ``[-ndim - 1, ndim]``, else torch's
    IndexError)."""
    d = norm_dim(dim, len(shape) + 1)
    return (*shape[:d], 1, *shape[d:])


def squeezed_shape(shape: Shape, dims: Any = None) -> Shape:
    """``shape`` after ``squeeze(dims)``: every size-1 dim when ``dims`` is None or empty, else
    the listed ones that have size 1 (out of range: torch's IndexError)."""
    if dims is None or dims == ():
        drop = {i for i, s in enumerate(shape) if s == 1}
    else:
        listed = (dims,) if isinstance(dims, int) else tuple(dims)
        drop = {d for d in (norm_dim(a, len(shape)) for a in listed)
                if len(shape) and shape[d] == 1}
    return tuple(s for i, s in enumerate(shape) if i not in drop)


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
    """``view``/``reshape``/``flatten``/``unflatten``/``squeeze``/``unsqueeze``. Dims are
    grouped into blocks of equal products; size-1 dims are ignored. A shard of dim ``d``
    survives, onto the first non-1 dim of its block's output, when ``d`` is the first non-1 dim
    of its block and either the block maps one non-1 dim onto one (kept whole: torch.chunk's
    pieces, however uneven, do not change) or ``d`` and the dim it becomes divide evenly over
    the ranks sharding ``d``. Else the dim is gathered first, on every mesh dim sharding it.
    Partial placements pass through (a view is linear)."""
    (x,) = metas
    src = tuple(x.shape)
    out_shape = infer_shape(math.prod(src), shape)
    if 0 in src:  # nothing to keep apart: gather the shards (cheap, the tensor is empty)
        pl = tuple(REPLICATE if type(p) is Shard else p for p in x.placements)
        return OpSharding((pl,), (pl,), (out_shape,))
    onto: dict[int, int] = {}  # input dim -> output dim its shard may become
    for a, b in _blocks(src, out_shape):
        big_a = [d for d in a if src[d] != 1]
        big_b = [d for d in b if out_shape[d] != 1]
        if big_a and big_b:
            onto[big_a[0]] = big_b[0] if len(big_a) > 1 or len(big_b) > 1 else -1 - big_b[0]
    ways: dict[int, int] = {}
    for m, p in enumerate(x.placements):
        if type(p) is Shard:
            ways[p.dim] = ways.get(p.dim, 1) * mesh_shape[m]
    kept: dict[int, int] = {}  # sharded input dim -> its output dim, where the shard survives
    for d, n in ways.items():
        e = onto.get(d)
        if e is not None and e < 0:  # one dim onto one of the same size: kept whole
            kept[d] = -1 - e
        elif e is not None and src[d] % n == 0 and out_shape[e] % n == 0:
            kept[d] = e
    target = tuple(REPLICATE if type(p) is Shard and p.dim not in kept else p
                   for p in x.placements)
    outs = tuple(Shard(kept[p.dim]) if type(p) is Shard else p for p in target)
    return OpSharding((target,), (outs,), (out_shape,))


def _permuted(op: str, x: TensorMeta, perm: tuple[int, ...]) -> OpSharding:
    if sorted(perm) != list(range(len(x.shape))):
        raise no_rule(op, (x,), f"{perm} is not a permutation of the dims")
    pl = tuple(Shard(perm.index(p.dim)) if type(p) is Shard else p for p in x.placements)
    return OpSharding((tuple(x.placements),), (pl,), (tuple(x.shape[d] for d in perm),))


def transposed_dims(nd: int, dim0: int, dim1: int) -> tuple[int, ...]:
    """The permutation ``transpose(dim0, dim1)`` (``swapaxes``) applies to ``nd`` dims (out of
    range dims raise IndexError, as in torch)."""
    perm = list(range(nd))
    a, b = norm_dim(dim0, nd), norm_dim(dim1, nd)
    if nd:
        perm[a], perm[b] = perm[b], perm[a]
    return tuple(perm)


def permuted_dims(nd: int, dims: Any) -> tuple[int, ...]:
    """``permute(dims)``'s dims made non-negative (out of range raises IndexError)."""
    return tuple(norm_dim(d, nd) for d in dims)


def matrix_transposed_dims(nd: int, last_two: bool) -> tuple[int, ...]:
    """The permutation of ``t``/``.T`` (all dims reversed) or, with ``last_two``, of ``.mT``
    (the last two swapped); below two dims nothing moves."""
    if nd < 2:
        return tuple(range(nd))
    if last_two:
        return (*range(nd - 2), nd - 1, nd - 2)
    return tuple(range(nd - 1, -1, -1))


def moved_dims(nd: int, source: Any, destination: Any) -> tuple[int, ...]:
    """The permutation of ``movedim(source, destination)``: the ``source`` dims land at
    ``destination``, the others keep their order."""
    src = [source] if isinstance(source, int) else list(source)
    dst = [destination] if isinstance(destination, int) else list(destination)
    src = [norm_dim(s, nd) for s in src]
    dst = [norm_dim(d, nd) for d in dst]
    if len(src) != len(dst) or len(set(src)) != len(src) or len(set(dst)) != len(dst):
        raise RuntimeError(f"movedim: source {src} and destination {dst} must name as many "
                           "dims, each once")
    perm = [-1] * nd
    for s, d in zip(src, dst, strict=True):
        perm[d] = s
    rest = iter(d for d in range(nd) if d not in src)
    return tuple(p if p >= 0 else next(rest) for p in perm)


@rule("transpose")
def _transpose(op: str, metas: tuple[TensorMeta, ...], mesh_shape: tuple[int, ...], *,
               dim0: int, dim1: int, **_: Any) -> OpSharding:
    (x,) = metas
    return _permuted(op, x, transposed_dims(len(x.shape), dim0, dim1))


@rule("permute")
def _permute(op: str, metas: tuple[TensorMeta, ...], mesh_shape: tuple[int, ...], *,
             dims: Any, **_: Any) -> OpSharding:
    (x,) = metas
    return _permuted(op, x, permuted_dims(len(x.shape), dims))
