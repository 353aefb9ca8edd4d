"""Megatron-style communication primitives on *local* tensors.

These are the only collectives the tensor-parallel fast path issues. Each is an autograd
function whose backward is chosen for tensor parallelism, which is not always the adjoint of
the forward collective:

=====================================  ==========================  ============================
primitive                              forward                     backward
=====================================  ==========================  ============================
:func:`copy_to_region` (Megatron f)    identity                    all-reduce (grads are partial)
:func:`reduce_from_region` (g)         all-reduce                  identity (grad is replicated)
:func:`gather_from_region`             all-gather along ``dim``    keep this rank's chunk
:func:`scatter_to_region`              keep this rank's chunk      all-gather along ``dim``
:func:`gather_from_sequence_region`    all-gather along ``dim``    reduce-scatter (partial grads)
:func:`reduce_scatter_to_region`       reduce-scatter              all-gather
:func:`all_to_all_region`              all-to-all                  all-to-all, dims swapped
=====================================  ==========================  ============================

Everything goes through :func:`hyperpar.platform.get_platform` at call time; ``group`` is an
opaque platform group handle (``None`` is the world group).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch

from hyperpar.dtensor.placement import Shard
from hyperpar.platform import get_platform

Group = Any


def _norm_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def all_gather_along(tensor: torch.Tensor, dim: int, group: Group = None) -> torch.Tensor:
    """Non-differentiable all-gather of equal-shaped ``tensor`` concatenated along ``dim``."""
    platform = get_platform()
    n = platform.world_size(group)
    if n == 1:
        return tensor
    dim = _norm_dim(dim, tensor.dim())
    flat = torch.empty((n * tensor.numel(),), dtype=tensor.dtype, device=tensor.device)
    platform.all_gather_into_tensor(flat, tensor.contiguous().view(-1), group)
    stacked = flat.view(n, *tensor.shape)
    if dim == 0:
        return stacked.view(n * tensor.shape[0], *tensor.shape[1:])
    return torch.cat(stacked.unbind(0), dim=dim)


def local_chunk(tensor: torch.Tensor, dim: int, group: Group = None) -> torch.Tensor:
    """This rank's equal chunk of ``tensor`` along ``dim`` (contiguous copy)."""
    platform = get_platform()
    n = platform.world_size(group)
    if n == 1:
        return tensor
    size = tensor.shape[dim]
    if size % n:
        raise ValueError(
            f"cannot split dim {dim} of size {size} evenly over {n} ranks; tensor-parallel "
            f"boundaries need sizes divisible by the mesh dimension"
        )
    return tensor.chunk(n, dim)[platform.rank(group)].contiguous()


def all_reduce_out_of_place(tensor: torch.Tensor, group: Group = None,
                            op: str = "sum") -> torch.Tensor:
    out = tensor.contiguous().clone()
    get_platform().all_reduce(out, op, group)
    return out


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce_out_of_place(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        if x.is_leaf or x._base is not None or not x.is_contiguous():
            return all_reduce_out_of_place(x, group)
        # A fresh module output (a matmul's result): reduce in place, as Megatron does. Marked
        # dirty, so if anything had saved it for backward autograd raises instead of using it.
        get_platform().all_reduce(x, "sum", group)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return all_gather_along(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return local_chunk(grad, ctx.dim, ctx.group), None, None


class _RegatheredView(torch.autograd.Function):
    """The already all-gathered ``gathered`` (no communication), differentiated w.r.t. the
    ``shard`` it came from: backward reduce-scatters the (partial) gradient to the shard."""

    @staticmethod
    def forward(ctx, shard, gathered, dim, group):
        ctx.dim, ctx.group = dim, group
        return gathered.view_as(gathered)

    @staticmethod
    def backward(ctx, grad):
        platform = get_platform()
        out = platform.reduce_scatter_autograd(grad.contiguous(), ctx.dim, "sum", ctx.group)
        return out, None, None, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return local_chunk(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_along(grad, ctx.dim, ctx.group), None, None


def _single(group: Group) -> bool:
    return get_platform().world_size(group) == 1


def copy_to_region(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Megatron's *f*: identity forward, all-reduce (sum) of the gradient backward."""
    return x if _single(group) else _CopyToRegion.apply(x, group)


def reduce_from_region(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Megatron's *g*: all-reduce (sum) forward, identity backward."""
    return x if _single(group) else _ReduceFromRegion.apply(x, group)


def gather_from_region(x: torch.Tensor, dim: int = -1, group: Group = None) -> torch.Tensor:
    """All-gather along ``dim`` forward; backward keeps this rank's chunk of the (replicated)
    gradient."""
    return x if _single(group) else _GatherFromRegion.apply(x, dim, group)


def scatter_to_region(x: torch.Tensor, dim: int = -1, group: Group = None) -> torch.Tensor:
    """Keep this rank's chunk along ``dim`` forward; all-gather the gradient backward."""
    return x if _single(group) else _ScatterToRegion.apply(x, dim, group)


def gather_from_sequence_region(x: torch.Tensor, dim: int = 1,
                                group: Group = None) -> torch.Tensor:
    """All-gather along ``dim`` forward; reduce-scatter (sum) of partial gradients backward."""
    if _single(group):
        return x
    return get_platform().all_gather_autograd(x.contiguous(), _norm_dim(dim, x.dim()), group)


def reduce_scatter_to_region(x: torch.Tensor, dim: int = 1, group: Group = None) -> torch.Tensor:
    """Reduce-scatter (sum) along ``dim`` forward; all-gather of the gradient backward."""
    if _single(group):
        return x
    return get_platform().reduce_scatter_autograd(x.contiguous(), _norm_dim(dim, x.dim()), "sum",
                                                  group)


def all_to_all_region(x: torch.Tensor, split_dim: int, concat_dim: int,
                      group: Group = None) -> torch.Tensor:
    """Re-shard from ``concat_dim`` to ``split_dim`` (an all-to-all); differentiable."""
    if _single(group):
        return x
    return get_platform().all_to_all_autograd(
        x.contiguous(), _norm_dim(split_dim, x.dim()), _norm_dim(concat_dim, x.dim()), group
    )


# ---------------------------------------------------------------------------------------------
# Placement transitions on local tensors (one mesh dimension).
# Convention (the DTensor one): the gradient of a value laid out as ``dst`` arrives laid out as
# ``grad_placements_of(dst)`` (a replicated value has a full, identical gradient on every rank),
# and backward re-lays it out as ``src``.


def _shard_dim(placement: Any, ndim: int) -> int | None:
    if isinstance(placement, Shard):
        return _norm_dim(placement.dim, ndim)
    return None


def _keep(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x


# gathered output id -> (weak ref to it, the shard it came from, dim, group). Kept beside the
# tensor, not on it: an attribute would make user-visible outputs unpicklable (a process group)
# and would travel with the tensor into user code.
_GATHERED_FROM: dict[int, tuple[weakref.ref, torch.Tensor, int, Group]] = {}


def _remember_gather(out: torch.Tensor, shard: torch.Tensor, dim: int, group: Group) -> None:
    key = id(out)
    _GATHERED_FROM[key] = (weakref.ref(out), shard, dim, group)
    weakref.finalize(out, _GATHERED_FROM.pop, key, None)


def _gathered_origin(x: torch.Tensor) -> tuple[torch.Tensor, int, Group] | None:
    entry = _GATHERED_FROM.get(id(x))
    if entry is None or entry[0]() is not x:
        return None
    return entry[1], entry[2], entry[3]


def _gather_tagged(dim: int) -> Callable[[torch.Tensor, Group], torch.Tensor]:
    def run(x: torch.Tensor, group: Group) -> torch.Tensor:
        out = gather_from_region(x, dim, group)
        if out is not x:
            # Let a column-parallel consumer route its (partial) gradient straight back to the
            # shard with one reduce-scatter instead of all-reduce + slice (to_replicated_input).
            _remember_gather(out, x, dim, group)
        return out
    return run


@functools.lru_cache(maxsize=512)
def transition(src: Any, dst: Any, ndim: int) -> Callable[[torch.Tensor, Group], torch.Tensor]:
    """The function ``(local, group) -> local`` that re-lays out a local piece of an
    ``ndim``-dim tensor from placement ``src`` to ``dst`` on one mesh dimension (cached: the
    boundaries of a model resolve once)."""
    s, d = _shard_dim(src, ndim), _shard_dim(dst, ndim)
    if s is not None and d is not None:
        if s == d:
            return _keep
        return lambda x, g: all_to_all_region(x, split_dim=d, concat_dim=s, group=g)
    if src == dst:
        return _keep
    if s is not None and dst.is_replicate():
        return _gather_tagged(s)
    if src.is_replicate() and d is not None:
        return lambda x, g: scatter_to_region(x, d, g)
    if src.is_partial("sum") and dst.is_replicate():
        return reduce_from_region
    if src.is_partial("sum") and d is not None:
        return lambda x, g: reduce_scatter_to_region(x, d, g)
    raise NotImplementedError(
        f"tensor-parallel boundary: redistributing {src!r} -> {dst!r} is not supported on the "
        f"fast path (supported: Shard<->Replicate, Shard(i)->Shard(j), Partial('sum')->"
        f"Replicate/Shard)"
    )


def redistribute_local(x: torch.Tensor, src: Any, dst: Any, group: Group = None) -> torch.Tensor:
    """Re-lay out ``x`` (this rank's local piece under placement ``src``) as ``dst``, both
    placements of one mesh dimension whose process group is ``group``. Differentiable."""
    return transition(src, dst, x.dim())(x, group)


class _LastInputMemo:
    """Remembers the last (input, layout) -> prepared-input conversion per process group, so
    sibling projections fed the same tensor (q/k/v, w1/w3) share one boundary collective: one
    all-reduce of the summed gradient instead of one per projection (as Megatron does)."""

    def __init__(self) -> None:
        self._entries: dict[Any, tuple[Any, Any, torch.Tensor]] = {}

    def get(self, key: Any, x: Any, layout: Any) -> torch.Tensor | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        ref, entry_layout, out = entry
        if ref() is x and entry_layout == layout and torch.is_grad_enabled() == out.requires_grad:
            return out
        return None

    def put(self, key: Any, x: Any, layout: Any, out: torch.Tensor) -> None:
        import weakref

        try:
            ref = weakref.ref(x)
        except TypeError:
            return
        self._entries[key] = (ref, layout, out)

    def clear(self) -> None:
        self._entries.clear()


_MEMO = _LastInputMemo()


def to_replicated_input(x: torch.Tensor, src: Any, group: Group = None, *,
                        memo_key: Any = None, memo_of: Any = None) -> torch.Tensor:
    """Prepare the input of a column-parallel matmul: replicate ``x`` (laid out as ``src``)
    knowing that the gradient coming back is *partial* (each rank saw only its columns).

    ``Replicate`` -> Megatron's f (all-reduce in backward); ``Shard(i)`` -> all-gather forward,
    reduce-scatter backward. ``memo_of`` (the caller's original input object) enables sharing
    the conversion between sibling projections.
    """
    if memo_of is not None:
        hit = _MEMO.get(memo_key, memo_of, src)
        if hit is not None:
            return hit
    s = _shard_dim(src, x.dim())
    origin = _gathered_origin(x)
    if s is not None:
        out = gather_from_sequence_region(x, s, group)
    elif src.is_replicate() and origin is not None and origin[2] == group:
        shard, dim, _ = origin
        out = _RegatheredView.apply(shard, x.detach(), dim, group)
    elif src.is_replicate():
        out = copy_to_region(x, group)
    elif src.is_partial("sum"):
        # reduce now; the replicated value then feeds a column-parallel matmul (partial grads)
        out = copy_to_region(reduce_from_region(x, group), group)
    else:
        raise NotImplementedError(f"column-parallel input laid out as {src!r} is not supported")
    if memo_of is not None and out is not x:
        _MEMO.put(memo_key, memo_of, src, out)
    return out
