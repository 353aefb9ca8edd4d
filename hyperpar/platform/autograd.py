"""The differentiable collectives behind :meth:`Platform.all_reduce_autograd` and friends.

Each forward runs the platform's own collectives (so a backend's fallbacks and tracing apply);
each backward is the exact adjoint: all-reduce <-> all-reduce, all-gather <-> reduce-scatter,
all-to-all <-> all-to-all with the two dims swapped.
"""

from __future__ import annotations

from typing import Any

import torch

Group = Any


def all_reduce(platform: Any, tensor: torch.Tensor, op: str, group: Group) -> torch.Tensor:
    """Out-of-place all-reduce (``sum`` or ``avg``) whose backward all-reduces the gradient."""
    if op not in ("sum", "avg"):
        raise ValueError(f"all_reduce_autograd supports 'sum' and 'avg', got {op!r}")
    return _AllReduce.apply(tensor, platform, op, group)


def all_gather(platform: Any, tensor: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """All-gather along ``dim``; backward reduce-scatters (sum) the gradient along ``dim``."""
    return _AllGather.apply(tensor, platform, dim, group)


def reduce_scatter(platform: Any, tensor: torch.Tensor, dim: int, op: str,
                   group: Group) -> torch.Tensor:
    """Reduce-scatter along ``dim``; backward all-gathers the gradient (divided by n for avg)."""
    if op not in ("sum", "avg"):
        raise ValueError(f"reduce_scatter_autograd supports 'sum' and 'avg', got {op!r}")
    _check_divisible("reduce_scatter_autograd", tensor, dim, platform.world_size(group))
    return _ReduceScatter.apply(tensor, platform, dim, op, group)


def all_to_all(platform: Any, tensor: torch.Tensor, split_dim: int, concat_dim: int,
               group: Group) -> torch.Tensor:
    """All-to-all from ``split_dim`` to ``concat_dim``; backward swaps the two dims."""
    _check_divisible("all_to_all_autograd", tensor, split_dim, platform.world_size(group))
    return _AllToAll.apply(tensor, platform, split_dim, concat_dim, group)


def all_to_all_single(platform: Any, tensor: torch.Tensor,
                      output_split_sizes: list[int] | None, input_split_sizes: list[int] | None,
                      group: Group) -> torch.Tensor:
    """Uneven dim-0 all-to-all: ``input_split_sizes[j]`` rows go to rank ``j``,
    ``output_split_sizes[j]`` rows arrive from it (None: equal pieces). Backward is the same
    exchange with the two split lists swapped, so every row's gradient returns to its sender."""
    n = platform.world_size(group)
    for what, sizes in (("output", output_split_sizes), ("input", input_split_sizes)):
        if sizes is not None and len(sizes) != n:
            raise ValueError(f"all_to_all_single_autograd: {len(sizes)} {what} split sizes for a "
                             f"group of {n} ranks; give one size per rank")
    if input_split_sizes is not None and sum(input_split_sizes) != tensor.shape[0]:
        raise ValueError(f"all_to_all_single_autograd: input split sizes sum to "
                         f"{sum(input_split_sizes)} but the input has {tensor.shape[0]} rows")
    if input_split_sizes is None:
        _check_divisible("all_to_all_single_autograd", tensor, 0, n)
    outs = None if output_split_sizes is None else [int(v) for v in output_split_sizes]
    ins = None if input_split_sizes is None else [int(v) for v in input_split_sizes]
    return _AllToAllSingle.apply(tensor, platform, outs, ins, group)


def _check_divisible(name: str, tensor: torch.Tensor, dim: int, n: int) -> None:
    # Equal pieces only: the backward's gather assumes every rank holds the same shape.
    if tensor.shape[dim] % n:
        raise ValueError(
            f"{name} along dim {dim}: size {tensor.shape[dim]} is not divisible by the group "
            f"size {n}; pad the tensor, or use a DTensor Shard, which handles uneven pieces"
        )


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, platform, op, group):
        ctx.platform, ctx.op, ctx.group = platform, op, group
        out = x.detach().clone()
        platform.all_reduce(out, op, group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        ctx.platform.all_reduce(grad, ctx.op, ctx.group)
        return grad, None, None, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, platform, dim, group):
        ctx.platform, ctx.dim, ctx.group = platform, dim, group
        return platform.all_gather_along(x.detach(), dim, group)

    @staticmethod
    def backward(ctx, grad):
        return ctx.platform.reduce_scatter_along(grad, ctx.dim, "sum", ctx.group), None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, platform, dim, op, group):
        ctx.platform, ctx.dim, ctx.op, ctx.group = platform, dim, op, group
        return platform.reduce_scatter_along(x.detach(), dim, op, group)

    @staticmethod
    def backward(ctx, grad):
        full = ctx.platform.all_gather_along(grad, ctx.dim, ctx.group)
        if ctx.op == "avg":
            full = full / ctx.platform.world_size(ctx.group)
        return full, None, None, None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, platform, split_dim, concat_dim, group):
        ctx.platform, ctx.dims, ctx.group = platform, (split_dim, concat_dim), group
        return platform.all_to_all_along(x.detach(), split_dim, concat_dim, group)

    @staticmethod
    def backward(ctx, grad):
        split_dim, concat_dim = ctx.dims
        out = ctx.platform.all_to_all_along(grad, concat_dim, split_dim, ctx.group)
        return out, None, None, None, None


class _AllToAllSingle(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, platform, out_splits, in_splits, group):
        ctx.platform, ctx.splits, ctx.group = platform, (out_splits, in_splits), group
        ctx.in_rows = x.shape[0]
        x = x.detach().contiguous()
        rows = sum(out_splits) if out_splits is not None else x.shape[0]
        out = x.new_empty((rows, *x.shape[1:]))
        platform.all_to_all_single(out, x, out_splits, in_splits, group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        grad = grad.contiguous()
        back = grad.new_empty((ctx.in_rows, *grad.shape[1:]))
        ctx.platform.all_to_all_single(back, grad, in_splits, out_splits, ctx.group)
        return back, None, None, None, None
