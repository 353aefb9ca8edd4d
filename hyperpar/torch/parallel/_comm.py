"""Tensor-parallel boundaries: the DTensor redistribution plan on a 1-D mesh, run on *local*
tensors with the backward choices of tensor parallelism.

Which collective a boundary issues is decided by the one planner,
:func:`hyperpar.torch.dtensor.redistribute.plan_redistribute` (a 1-D plan has one or two steps);
the collectives along a dimension are the platform's
(:class:`~hyperpar.platform.dim_collectives.DimCollectives`), uneven pieces included. This
module only adds what a per-op DTensor does not know: each step's backward, chosen for tensor
parallelism, which is not always the adjoint of the forward:

=====================================  ==========================  ============================
step / primitive                       forward                     backward
=====================================  ==========================  ============================
:func:`copy_to_region` (Megatron f)    identity                    all-reduce (grads are partial)
``allreduce`` (Megatron g)             all-reduce (in place)       identity (grad is replicated)
``gather``                             all-gather along ``dim``    keep this rank's piece
``chunk``                              keep this rank's piece      all-gather along ``dim``
``reduce_scatter``                     reduce-scatter              all-gather
``all_to_all``                         all-to-all                  all-to-all, dims swapped
:func:`to_replicated_input`            all-gather (Shard input)    reduce-scatter (partial grads)
=====================================  ==========================  ============================

Pieces follow ``torch.chunk`` (like DTensor's ``Shard``). A boundary that gathers a plain
tensor declared ``Shard(d)`` does not know the other ranks' lengths: it exchanges them first
(one small all-gather) and raises on every rank if they are not a ``torch.chunk`` split.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch

from hyperpar.dtensor.layout import check_chunk_split
from hyperpar.dtensor.placement import Placement, Shard, chunk_bounds
from hyperpar.platform import get_platform
from hyperpar.torch.dtensor.redistribute import plan_redistribute

Group = Any
Mesh = Any  # a 1-D hyperpar DeviceMesh


def _norm_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


@functools.lru_cache(maxsize=1024)
def _sizes(full: int, n: int) -> tuple[int, ...]:
    return tuple(chunk_bounds(full, n, k)[1] for k in range(n))


@functools.lru_cache(maxsize=64)
def _mesh_info(mesh: Mesh) -> tuple[Group, int, int]:
    """``(group, size, this rank's index)`` of a 1-D mesh, resolved once."""
    return mesh.get_group(0), mesh.size(0), mesh.get_local_rank(0)


def full_length(local: torch.Tensor, dim: int, mesh: Mesh) -> int:
    """Global length along ``dim`` of a plain local piece laid out as ``Shard(dim)`` on the 1-D
    ``mesh``: the pieces' lengths are exchanged (one small all-gather) and must be a
    ``torch.chunk`` split, else every rank raises the same error."""
    n = mesh.size(0)
    if n == 1:
        return local.shape[dim]
    if torch.compiler.is_compiling():
        return _even_full_length_checked(local, dim, n, mesh)
    lengths = get_platform().all_gather_sizes(local.shape[dim], mesh.get_group(0))
    return check_chunk_split(lengths, dim, "tensor-parallel boundary")


def _even_full_length_checked(local: torch.Tensor, dim: int, n: int, mesh: Mesh) -> int:
    """:func:`full_length` inside ``torch.compile``: an int read out of a collective would be
    a graph break, so the pieces are taken to be even (as torch does) and the graph checks it
    -- the lengths are still exchanged, and every rank raises if they differ."""
    mine = local.shape[dim]
    lengths = get_platform().all_gather_along(
        torch.full((1,), mine, dtype=torch.int64, device=local.device), 0, mesh.get_group(0))
    torch._assert_async(
        torch.all(lengths == mine),
        f"tensor-parallel boundary under torch.compile: the local pieces laid out as "
        f"Shard({dim}) differ in length across the {n} ranks; a compiled region needs even "
        f"pieces: keep that dim divisible by the mesh size or pass a DTensor")
    return mine * n


def _piece(x: torch.Tensor, dim: int, sizes: tuple[int, ...], index: int) -> torch.Tensor:
    return x.narrow(dim, sum(sizes[:index]), sizes[index]).contiguous()


# --------------------------------------------------------------------- autograd functions
class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        out = grad.contiguous().clone()
        get_platform().all_reduce(out, "sum", ctx.group)
        return out, None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, op, group):
        # Compiled: out of place (a graph gains nothing from reducing in place, and Dynamo 2.6
        # refuses x.is_contiguous() inside an autograd.Function: "Illegal getattr invocation")
        if (torch.compiler.is_compiling() or x.is_leaf or x._base is not None
                or not x.is_contiguous()):
            out = x.contiguous().clone()
            get_platform().all_reduce(out, op, group)
            return out
        # A fresh module output (a matmul's result): reduce in place, as Megatron does. Marked
        # dirty, so if anything had saved it for backward autograd raises instead of using it.
        get_platform().all_reduce(x, op, group)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _Gather(torch.autograd.Function):
    """All-gather forward; backward keeps this rank's piece of the replicated gradient."""

    @staticmethod
    def forward(ctx, x, dim, sizes, index, group):
        ctx.args = (dim, sizes, index)
        return get_platform().all_gather_along(x, dim, group, sizes=sizes)

    @staticmethod
    def backward(ctx, grad):
        return _piece(grad, *ctx.args), None, None, None, None


class _GatherPartialGrad(torch.autograd.Function):
    """All-gather forward; backward reduce-scatters the (partial) gradient to the piece."""

    @staticmethod
    def forward(ctx, x, dim, sizes, group):
        ctx.args = (dim, sizes, group)
        return get_platform().all_gather_along(x, dim, group, sizes=sizes)

    @staticmethod
    def backward(ctx, grad):
        dim, sizes, group = ctx.args
        out = get_platform().reduce_scatter_along(grad.contiguous(), dim, "sum", group,
                                                  sizes=sizes)
        return out, None, None, None


class _RegatheredView(torch.autograd.Function):
    """The already all-gathered ``gathered`` (no communication), differentiated w.r.t. the
    ``shard`` it came from: backward reduce-scatters the (partial) gradient to the shard."""

    @staticmethod
    def forward(ctx, shard, gathered, dim, sizes, group):
        ctx.args = (dim, sizes, group)
        return gathered.view_as(gathered)

    @staticmethod
    def backward(ctx, grad):
        dim, sizes, group = ctx.args
        out = get_platform().reduce_scatter_along(grad.contiguous(), dim, "sum", group,
                                                  sizes=sizes)
        return out, None, None, None, None


class _Chunk(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, index, group):
        sizes = _sizes(x.shape[dim], get_platform().world_size(group))
        ctx.args = (dim, sizes, group)
        return _piece(x, dim, sizes, index)

    @staticmethod
    def backward(ctx, grad):
        dim, sizes, group = ctx.args
        return get_platform().all_gather_along(grad, dim, group, sizes=sizes), None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, op, group):
        sizes = _sizes(x.shape[dim], get_platform().world_size(group))
        ctx.args = (dim, sizes, group)
        return get_platform().reduce_scatter_along(x, dim, op, group, sizes=sizes)

    @staticmethod
    def backward(ctx, grad):
        dim, sizes, group = ctx.args
        return get_platform().all_gather_along(grad, dim, group, sizes=sizes), None, None, None


class _AllToAll(torch.autograd.Function):
    """Shard(concat) -> Shard(split); backward is the same exchange the other way round."""

    @staticmethod
    def forward(ctx, x, split, concat, concat_sizes, group):
        split_sizes = _sizes(x.shape[split], len(concat_sizes))
        ctx.args = (split, concat, split_sizes, concat_sizes, group)
        return get_platform().all_to_all_along(x, split, concat, group, split_sizes=split_sizes,
                                               concat_sizes=concat_sizes)

    @staticmethod
    def backward(ctx, grad):
        split, concat, split_sizes, concat_sizes, group = ctx.args
        out = get_platform().all_to_all_along(grad, concat, split, group,
                                              split_sizes=concat_sizes, concat_sizes=split_sizes)
        return out, None, None, None, None


class _ToPartial(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, op, index):
        return torch.zeros_like(x) if op == "sum" and index != 0 else x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


# --------------------------------------------------------------------- primitives
def copy_to_region(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Megatron's *f*: identity forward, all-reduce (sum) of the gradient backward."""
    return x if get_platform().world_size(group) == 1 else _Copy.apply(x, group)


# gathered output id -> (weak ref to it, the shard it came from, dim, sizes, group). Kept beside
# the tensor, not on it: an attribute would make user-visible outputs unpicklable (a process
# group) and would travel with the tensor into user code.
_GATHERED_FROM: dict[int, tuple[weakref.ref, torch.Tensor, int, tuple[int, ...], Group]] = {}


def _remember_gather(out: torch.Tensor, shard: torch.Tensor, dim: int,
                     sizes: tuple[int, ...], group: Group) -> None:
    key = id(out)
    _GATHERED_FROM[key] = (weakref.ref(out), shard, dim, sizes, group)
    weakref.finalize(out, _GATHERED_FROM.pop, key, None)


def _gathered_origin(x: torch.Tensor) -> tuple[torch.Tensor, int, tuple[int, ...], Group] | None:
    if torch.compiler.is_compiling():  # ids and weak refs of traced tensors mean nothing
        return None
    entry = _GATHERED_FROM.get(id(x))
    if entry is None or entry[0]() is not x:
        return None
    return entry[1], entry[2], entry[3], entry[4]


# --------------------------------------------------------------------- the boundary
def _resolve(p: Placement, ndim: int) -> Placement:
    return Shard(p.dim + ndim) if type(p) is Shard and p.dim < 0 else p


@functools.lru_cache(maxsize=512)
def _steps(src: Placement, dst: Placement, ndim: int, mesh: Mesh) -> tuple[tuple, ...]:
    """The redistribution plan ``src -> dst`` on the 1-D ``mesh``, with what running it needs
    (``(kind, arg1, arg2, group, mesh size, this rank's index)`` per step); cached, so a
    model's boundaries resolve once. 1-D plans do not depend on the tensor's shape."""
    s, d = _resolve(src, ndim), _resolve(dst, ndim)
    group, n, index = _mesh_info(mesh)
    return tuple((kind, a, b, group, n, index)
                 for kind, _, _, a, b in plan_redistribute(mesh, (s,), (d,), ()))


def needs_full_length(src: Placement, dst: Placement, ndim: int, mesh: Mesh) -> bool:
    """Whether ``src -> dst`` must know the other ranks' lengths along ``src``'s shard dim."""
    return any(step[0] in ("gather", "all_to_all") for step in _steps(src, dst, ndim, mesh))


def redistribute_boundary(x: torch.Tensor, src: Placement, dst: Placement, mesh: Mesh, *,
                          full: int | None = None, tag_gather: bool = True) -> torch.Tensor:
    """Re-lay out ``x``, this rank's piece under ``src``, as ``dst`` on the 1-D ``mesh`` (the
    DTensor plan, the tensor-parallel backward). Differentiable.

    ``full`` is the global length along ``src``'s shard dim when the caller knows it (a
    DTensor's shape, a weight's size); otherwise a gather exchanges the lengths first.
    """
    steps = _steps(src, dst, x.dim(), mesh)
    for kind, a, b, group, n, index in steps:
        if kind == "gather":
            if full is None:
                full = full_length(x, a, mesh)
            sizes = _sizes(full, n)
            shard, x = x, _Gather.apply(x, a, sizes, index, group)
            if tag_gather and not torch.compiler.is_compiling():
                # Let a column-parallel consumer route its (partial) gradient straight back to
                # the shard with one reduce-scatter instead of all-reduce + slice.
                _remember_gather(x, shard, a, sizes, group)
        elif kind == "allreduce":
            x = _Reduce.apply(x, a, group)
        elif kind == "chunk":
            x = _Chunk.apply(x, a, index, group)
        elif kind == "reduce_scatter":
            x = _ReduceScatter.apply(x, a, b, group)
        elif kind == "all_to_all":
            if full is None:
                full = full_length(x, a, mesh)
            x = _AllToAll.apply(x, b, a, _sizes(full, n), group)
        elif kind == "to_partial":
            x = _ToPartial.apply(x, a, index)
        else:  # pragma: no cover
            raise AssertionError(kind)
    return x


def gather_ids(x: torch.Tensor, src: Placement, mesh: Mesh, full: int | None = None
               ) -> torch.Tensor:
    """Token ids (no gradient) laid out as ``src`` made replicated."""
    if type(src) is not Shard or mesh.size(0) == 1:
        return x
    dim = _norm_dim(src.dim, x.dim())
    if full is None:
        full = full_length(x, dim, mesh)
    return get_platform().all_gather_along(x, dim, mesh.get_group(0),
                                           sizes=_sizes(full, mesh.size(0)))


class _LastInputMemo:
    """Remembers the last (input, layout) -> prepared-input conversion per process group, so
    sibling projections fed the same tensor (q/k/v, w1/w3) share one boundary collective: one
    all-reduce of the summed gradient instead of one per projection (as Megatron does)."""

    def __init__(self) -> None:
        self._entries: dict[Any, tuple[Any, Any, torch.Tensor]] = {}

    def get(self, key: Any, x: Any, layout: Any) -> torch.Tensor | None:
        if torch.compiler.is_compiling():
            # A graph cannot hold weak refs to its tensors: compiled, each sibling converts
            # its input itself (one gradient all-reduce per projection instead of one).
            return None
        entry = self._entries.get(key)
        if entry is None:
            return None
        ref, entry_layout, out = entry
        if ref() is x and entry_layout == layout and torch.is_grad_enabled() == out.requires_grad:
            return out
        return None

    def put(self, key: Any, x: Any, layout: Any, out: torch.Tensor) -> None:
        if torch.compiler.is_compiling():
            return
        try:
            ref = weakref.ref(x)
        except TypeError:
            return
        self._entries[key] = (ref, layout, out)

    def clear(self) -> None:
        self._entries.clear()


_MEMO = _LastInputMemo()


def to_replicated_input(x: torch.Tensor, src: Placement, mesh: Mesh, *,
                        full: int | None = None) -> torch.Tensor:
    """Prepare the input of a column-parallel matmul: replicate ``x`` (laid out as ``src``)
    knowing that the gradient coming back is *partial* (each rank saw only its columns).

    ``Replicate`` -> Megatron's f (all-reduce in backward); ``Shard(i)`` -> all-gather forward,
    reduce-scatter backward (uneven pieces included; ``full`` as in
    :func:`redistribute_boundary`); ``Partial`` -> all-reduce, then f.
    """
    group, n, _ = _mesh_info(mesh)
    if n == 1:
        return x
    if type(src) is Shard:
        dim = _norm_dim(src.dim, x.dim())
        if full is None:
            full = full_length(x, dim, mesh)
        return _GatherPartialGrad.apply(x, dim, _sizes(full, n), group)
    if src.is_replicate():
        origin = _gathered_origin(x)
        if origin is not None and origin[3] == group:
            shard, dim, sizes, _ = origin
            return _RegatheredView.apply(shard, x.detach(), dim, sizes, group)
        return _Copy.apply(x, group)
    if src.is_partial():
        # reduce now; the replicated value then feeds a column-parallel matmul (partial grads)
        return _Copy.apply(_Reduce.apply(x, src.reduce_op, group), group)
    raise NotImplementedError(f"column-parallel input laid out as {src!r} is not supported")
