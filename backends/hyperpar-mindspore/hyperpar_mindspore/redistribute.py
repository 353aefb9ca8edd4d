"""Redistribution on MindSpore: execute the framework-neutral plan of
:mod:`hyperpar.dtensor.layout` on local tensors with the platform's collectives, differentiably.

Every step works on uneven shards (``torch.chunk``'s rule: 5 columns on 4 ranks are 2, 2, 1, 0):
pieces are padded to the largest one for the fixed-size collectives and trimmed after. The
backward of a redistribution is the adjoint redistribution (Partial replaced by Replicate, as the
gradient of a pending sum is the same on every rank), built as a ``mindspore.common._Function``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from mindspore import Tensor, mint
from mindspore.common import _Function

from hyperpar.dtensor.layout import Step, _plan, _size_at, _sizes
from hyperpar.dtensor.placement import Placement, chunk_bounds, grad_placements_of
from hyperpar.platform import get_platform

from .tensors import copy_tensor

Placements = tuple[Placement, ...]


def mesh_coordinate(mesh: Any) -> tuple[int, ...]:
    """This rank's coordinate, from the calls every mesh implementation answers."""
    return tuple(int(mesh.get_local_rank(d)) for d in range(mesh.ndim))


def _front(x: Tensor, d: int) -> Tensor:
    """``x`` with dim ``d`` moved to the front (a contiguous copy: collectives need one)."""
    if d == 0:
        return x
    perm = (d, *(i for i in range(x.ndim) if i != d))
    return mint.permute(x, perm).contiguous()


def _back(x: Tensor, d: int) -> Tensor:
    """Undo :func:`_front`."""
    if d == 0:
        return x
    perm = list(range(1, x.ndim))
    perm.insert(d, 0)
    return mint.permute(x, tuple(perm)).contiguous()


def _numel(x: Tensor) -> int:
    return math.prod(x.shape)


def _pad_rows(x: Tensor, rows: int) -> Tensor:
    if x.shape[0] >= rows:
        return x
    pad = mint.zeros((rows - x.shape[0], *x.shape[1:]), dtype=x.dtype)
    return mint.cat([x, pad]) if x.shape[0] else pad


def _cat(pieces: list[Tensor], dim: int, shape: tuple[int, ...], dtype: Any) -> Tensor:
    pieces = [p for p in pieces if p.shape[dim]]
    if not pieces:
        return mint.zeros(shape, dtype=dtype)
    return pieces[0] if len(pieces) == 1 else mint.cat(pieces, dim)


def _gather(x: Tensor, dim: int, sizes: list[int], group: Any) -> Tensor:
    n, most = len(sizes), sizes[0]  # torch.chunk: the first piece is the largest
    if most == 0 or not math.prod(x.shape[:dim] + x.shape[dim + 1:]):
        shape = list(x.shape)
        shape[dim] = sum(sizes)
        return mint.zeros(tuple(shape), dtype=x.dtype)  # nothing to move, on any rank
    xf = _pad_rows(_front(x, dim), most)
    out = mint.empty((n * most, *xf.shape[1:]), dtype=x.dtype)
    get_platform().all_gather_into_tensor(out, xf, group)
    pieces = [out[k * most:k * most + sizes[k]] for k in range(n)]
    full = _cat(pieces, 0, (sum(sizes), *xf.shape[1:]), x.dtype)
    return _back(full, dim)


def _reduce_scatter(x: Tensor, dim: int, op: str, n: int, me: int, group: Any) -> Tensor:
    sizes = _sizes(x.shape[dim], n)
    most = sizes[0]
    if not _numel(x):
        shape = list(x.shape)
        shape[dim] = sizes[me]
        return mint.zeros(tuple(shape), dtype=x.dtype)
    xf = _pad_rows(_front(x, dim), n * most)
    out = mint.empty((most, *xf.shape[1:]), dtype=x.dtype)
    get_platform().reduce_scatter_tensor(out, xf, op, group)
    return _back(out[:sizes[me]], dim)


def _all_to_all(x: Tensor, src: int, dst: int, src_sizes: list[int], n: int, me: int,
                group: Any) -> Tensor:
    """Shard(src) -> Shard(dst): send piece k of dim ``dst`` to rank k, receive every rank's
    piece of dim ``src``. Pieces travel flattened (they differ in shape when uneven)."""
    dst_sizes = _sizes(x.shape[dst], n)
    sends = []
    for k in range(n):
        off, length = chunk_bounds(x.shape[dst], n, k)
        sends.append(mint.narrow(x, dst, off, length).reshape(-1))
    inp = _cat(sends, 0, (0,), x.dtype)
    shapes = []
    for k in range(n):
        s = list(x.shape)
        s[src], s[dst] = src_sizes[k], dst_sizes[me]
        shapes.append(tuple(s))
    counts = [math.prod(s) for s in shapes]
    out = mint.empty((sum(counts),), dtype=x.dtype)
    get_platform().all_to_all_single(out, inp, counts, [math.prod(s.shape) for s in sends],
                                     group)
    pieces, at = [], 0
    for k in range(n):
        pieces.append(out[at:at + counts[k]].reshape(shapes[k]))
        at += counts[k]
    shape = list(x.shape)
    shape[src], shape[dst] = sum(src_sizes), dst_sizes[me]
    return _cat(pieces, src, tuple(shape), x.dtype)


def run_plan(x: Tensor, plan: Sequence[Step], mesh: Any, shape: tuple[int, ...]) -> Tensor:
    """Execute ``plan`` on the local tensor ``x`` (no autograd)."""
    coord = mesh_coordinate(mesh)
    mshape = tuple(mesh.shape)
    platform = get_platform()
    for kind, m, before, a, b in plan:
        n, group = mshape[m], mesh.get_group(m)
        if kind == "gather":
            x = _gather(x, a, _sizes(_size_at(shape, before, list(coord), mshape, m, a), n),
                        group)
        elif kind == "allreduce":
            x = copy_tensor(x)
            if _numel(x):  # an empty piece is empty on every rank of the group: skip together
                platform.all_reduce(x, a, group)
        elif kind == "chunk":
            x = mint.narrow(x, a, *chunk_bounds(x.shape[a], n, coord[m])).contiguous()
        elif kind == "reduce_scatter":
            x = _reduce_scatter(x, a, b, n, coord[m], group)
        elif kind == "all_to_all":
            full = _size_at(shape, before, list(coord), mshape, m, a)
            x = _all_to_all(x, a, b, _sizes(full, n), n, coord[m], group)
        elif kind == "to_partial":
            if a == "sum" and coord[m] != 0:
                x = mint.zeros(tuple(x.shape), dtype=x.dtype)
        else:  # pragma: no cover - the planner makes only the kinds above
            raise AssertionError(kind)
    return x


def redistribute_local(x: Tensor, mesh: Any, src: Placements, dst: Placements,
                       shape: tuple[int, ...]) -> Tensor:
    """Non-differentiable redistribution of a local tensor."""
    if src == dst:
        return x
    return run_plan(x, _plan(tuple(mesh.shape), tuple(src), tuple(dst)), mesh, shape)


class _Redistribute(_Function):
    """Differentiable redistribution; backward redistributes the gradient back."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, mesh: Any, src: Placements, dst: Placements,
                shape: tuple[int, ...]) -> Tensor:
        ctx.args = (mesh, src, dst, shape)
        return redistribute_local(x, mesh, src, dst, shape)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        mesh, src, dst, shape = ctx.args
        g = redistribute_local(grad, mesh, grad_placements_of(dst), grad_placements_of(src),
                               shape)
        return g, None, None, None, None


def redistribute(x: Tensor, mesh: Any, src: Placements, dst: Placements,
                 shape: tuple[int, ...]) -> Tensor:
    """Redistribute the local tensor ``x`` from ``src`` to ``dst``, differentiably."""
    if tuple(src) == tuple(dst):
        return x
    return _Redistribute.apply(x, mesh, tuple(src), tuple(dst), tuple(shape))


class _SumGrad(_Function):
    """Identity forward; backward sums the gradient over mesh dims (a replicated input that fed
    a sharded or Partial output has only this rank's term of its gradient)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, mesh: Any, dims: tuple[int, ...]) -> Tensor:
        ctx.args = (mesh, dims)
        return x * 1  # a new node: the identity itself would carry no backward

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        mesh, dims = ctx.args
        g = copy_tensor(grad)
        if _numel(g):  # replicated over these dims: empty on every rank of each group
            for m in dims:
                get_platform().all_reduce(g, "sum", mesh.get_group(m))
        return g, None, None


def sum_grad_over(x: Tensor, mesh: Any, dims: tuple[int, ...]) -> Tensor:
    """``x``, whose gradient is summed over mesh ``dims`` in backward."""
    dims = tuple(m for m in dims if mesh.size(m) > 1)
    return _SumGrad.apply(x, mesh, dims) if dims else x


__all__ = ["mesh_coordinate", "redistribute", "redistribute_local", "run_plan",
           "sum_grad_over"]
