"""Collectives along one tensor dimension, written once for every platform.

:class:`DimCollectives` is a mixin of :class:`~hyperpar.platform.base.Platform`: its methods are
concrete and use only the Platform's bulk collectives (``all_gather_into_tensor``,
``reduce_scatter_tensor``, ``all_to_all_single``) plus ``rank``/``world_size``, so a backend gets
them for free and may override them with a native version.

Every method supports *uneven* pieces. The default layout is ``torch.chunk``'s (pieces of
``ceil(size / n)``, the tail shorter or empty), which is the layout of a DTensor ``Shard``.
Uneven pieces travel padded to the largest piece and are trimmed on arrival; a collective only
ever sees equal shapes on every rank. Sizes that a rank cannot know locally (how long the other
ranks' pieces are) are passed in as ``sizes``; :meth:`DimCollectives.all_gather_sizes` exchanges
them when nothing else knows them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["DimCollectives", "chunk_sizes"]


def chunk_sizes(size: int, n: int) -> list[int]:
    """Lengths of the ``n`` pieces ``torch.chunk`` makes of ``size`` elements (``ceil(size/n)``
    each, the tail shorter or empty)."""
    step = -(-size // n) if n else 0
    return [max(0, min(step, size - k * step)) for k in range(n)]


def _pad_along(x: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    missing = length - x.shape[dim]
    if missing <= 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def _norm(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


class DimCollectives:
    """Gather, reduce-scatter and all-to-all of tensor *pieces along a dimension*.

    Non-differentiable building blocks of the DTensor redistribution planner, the tensor-
    parallel boundaries and the autograd collectives. ``group`` is a platform group handle
    (``None``: the world group); sizes are listed in group-rank order.
    """

    # Provided by Platform (abstract there); declared for type checkers and readers.
    rank: Any
    world_size: Any
    all_gather_into_tensor: Any
    reduce_scatter_tensor: Any
    all_to_all_single: Any

    def all_gather_sizes(self, size: int, group: Any = None) -> list[int]:
        """Every rank's ``size`` (an int), in group-rank order: one small all-gather. Use it
        before gathering pieces whose lengths only their owners know."""
        n = self.world_size(group)
        if n == 1:
            return [int(size)]
        mine = torch.tensor([int(size)], dtype=torch.int64, device=self._sizes_device())
        out = torch.empty(n, dtype=torch.int64, device=mine.device)
        self.all_gather_into_tensor(out, mine, group)
        return [int(v) for v in out.tolist()]

    def _sizes_device(self) -> torch.device:
        device = getattr(self, "device", None)
        return device() if callable(device) else torch.device("cpu")

    def all_gather_along(self, tensor: torch.Tensor, dim: int, group: Any = None, *,
                         sizes: Sequence[int] | None = None) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along ``dim`` in group-rank order.

        ``sizes[k]`` is rank ``k``'s length along ``dim`` (default: all equal to this rank's);
        the other dims must agree on every rank. Uneven pieces are padded and trimmed.
        """
        n = self.world_size(group)
        if n == 1:
            return tensor
        dim = _norm(dim, tensor.dim())
        mine = tensor.shape[dim]
        if sizes is None:
            sizes = [mine] * n
        elif len(sizes) != n or sizes[self.rank(group)] != mine:
            raise ValueError(
                f"all_gather_along(dim={dim}): sizes {list(sizes)} do not fit a group of {n} "
                f"in which this rank (index {self.rank(group)}) holds {mine}"
            )
        step = max(sizes)
        even = min(sizes) == step
        x = tensor.contiguous() if even else _pad_along(tensor, dim, step).contiguous()
        flat = torch.empty(n * x.numel(), dtype=x.dtype, device=x.device)
        self.all_gather_into_tensor(flat, x.view(-1), group)
        if even and dim == 0:
            return flat.view(n * step, *x.shape[1:])
        pieces = flat.view(n, *x.shape).unbind(0)
        if not even:
            pieces = [p.narrow(dim, 0, s) for p, s in zip(pieces, sizes, strict=True)]
        return torch.cat(pieces, dim=dim)

    def reduce_scatter_along(self, tensor: torch.Tensor, dim: int, op: str = "sum",
                             group: Any = None, *,
                             sizes: Sequence[int] | None = None) -> torch.Tensor:
        """Reduce ``tensor`` (the same shape on every rank) across ranks and keep this rank's
        piece along ``dim``. ``sizes`` are the pieces' lengths (default: ``torch.chunk``'s)."""
        n = self.world_size(group)
        if n == 1:
            return tensor
        dim = _norm(dim, tensor.dim())
        full = tensor.shape[dim]
        if sizes is None:
            sizes = chunk_sizes(full, n)
        elif len(sizes) != n or sum(sizes) != full:
            raise ValueError(
                f"reduce_scatter_along(dim={dim}): sizes {list(sizes)} must be {n} lengths "
                f"summing to the dim's size {full}"
            )
        step = max(sizes)
        even = min(sizes) == step
        if even and dim == 0:
            stacked = tensor.contiguous()
            out = torch.empty((step, *tensor.shape[1:]), dtype=tensor.dtype,
                              device=tensor.device)
        else:
            pieces = tensor.split(list(sizes), dim)
            if not even:
                pieces = [_pad_along(p, dim, step) for p in pieces]
            stacked = torch.stack(pieces).contiguous()
            out = torch.empty(stacked.shape[1:], dtype=tensor.dtype, device=tensor.device)
        self.reduce_scatter_tensor(out.view(-1), stacked.view(-1), op, group)
        mine = sizes[self.rank(group)]
        if mine != step:
            out = out.narrow(dim, 0, mine).contiguous()
        return out

    def all_to_all_along(self, tensor: torch.Tensor, split_dim: int, concat_dim: int,
                         group: Any = None, *,
                         split_sizes: Sequence[int] | None = None,
                         concat_sizes: Sequence[int] | None = None) -> torch.Tensor:
        """Split ``tensor`` along ``split_dim`` into pieces of ``split_sizes`` (default:
        ``torch.chunk``'s), send piece ``k`` to rank ``k``, and concatenate the pieces received
        along ``concat_dim``.

        ``concat_sizes[k]`` is rank ``k``'s length along ``concat_dim`` (default: all equal to
        this rank's); ``split_dim``'s size must be the same on every rank.
        """
        n = self.world_size(group)
        if n == 1:
            return tensor
        nd = tensor.dim()
        split_dim, concat_dim = _norm(split_dim, nd), _norm(concat_dim, nd)
        me = self.rank(group)
        mine = tensor.shape[concat_dim]
        if concat_sizes is None:
            concat_sizes = [mine] * n
        elif len(concat_sizes) != n or concat_sizes[me] != mine:
            raise ValueError(
                f"all_to_all_along(concat_dim={concat_dim}): sizes {list(concat_sizes)} do not "
                f"fit a group of {n} in which this rank (index {me}) holds {mine}"
            )
        split = list(split_sizes) if split_sizes is not None else chunk_sizes(
            tensor.shape[split_dim], n)
        if len(split) != n or sum(split) != tensor.shape[split_dim]:
            raise ValueError(
                f"all_to_all_along(split_dim={split_dim}): split sizes {split} must be {n} "
                f"lengths summing to the dim's size {tensor.shape[split_dim]}"
            )
        send = [p.contiguous().view(-1) for p in tensor.split(split, split_dim)]
        recv_shapes = []
        for k in range(n):
            shape = list(tensor.shape)
            shape[split_dim] = split[me]
            shape[concat_dim] = concat_sizes[k]
            recv_shapes.append(shape)
        out_sizes = [int(torch.Size(s).numel()) for s in recv_shapes]
        out = tensor.new_empty(sum(out_sizes))
        self.all_to_all_single(out, torch.cat(send), out_sizes, [t.numel() for t in send],
                               group)
        pieces = [p.view(s) for p, s in zip(out.split(out_sizes), recv_shapes, strict=True)]
        return torch.cat(pieces, dim=concat_dim)
