"""Collectives along one tensor dimension, written once for every platform and framework.

:class:`DimCollectives` is a mixin of :class:`~hyperpar.platform.base.Platform`: its methods are
concrete and use only the Platform's bulk collectives (``all_gather_into_tensor``,
``reduce_scatter_tensor``, ``all_to_all_single``), ``rank``/``world_size`` and the contract's
tensor mechanics (``cat``, ``split``, ``narrow``, ``pad_zeros``, ``reshape``, ``new_empty``,
``int_tensor``, ``to_ints``), so this module imports no framework: PyTorch's and MindSpore's
platforms run the same code, and a backend may still override a method with a native version.

Every method supports *uneven* pieces. The default layout is ``torch.chunk``'s (pieces of
``ceil(size / n)``, the tail shorter or empty), which is the layout of a DTensor ``Shard``.
Uneven pieces travel padded to the largest piece and are trimmed on arrival; a collective only
ever sees equal shapes on every rank. Sizes that a rank cannot know locally (how long the other
ranks' pieces are) are passed in as ``sizes``; :meth:`DimCollectives.all_gather_sizes` exchanges
them when nothing else knows them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

__all__ = ["DimCollectives", "chunk_sizes"]


def chunk_sizes(size: int, n: int) -> list[int]:
    """Lengths of the ``n`` pieces ``torch.chunk`` makes of ``size`` elements (``ceil(size/n)``
    each, the tail shorter or empty)."""
    step = -(-size // n) if n else 0
    return [max(0, min(step, size - k * step)) for k in range(n)]


def _offsets(sizes: Sequence[int]) -> list[int]:
    """Where each piece of ``sizes`` starts."""
    out, at = [], 0
    for size in sizes:
        out.append(at)
        at += size
    return out


def _norm(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def _with(shape: Sequence[int], dim: int, size: int) -> tuple[int, ...]:
    """``shape`` with ``shape[dim]`` replaced by ``size``."""
    out = list(shape)
    out[dim] = size
    return tuple(out)


class DimCollectives:
    """Gather, reduce-scatter and all-to-all of tensor *pieces along a dimension*.

    Non-differentiable building blocks of the DTensor redistribution planner, the tensor-
    parallel boundaries and the autograd collectives. ``group`` is a platform group handle
    (``None``: the world group); sizes are listed in group-rank order.
    """

    # Provided by Platform (collectives abstract there, tensor mechanics supplied by each
    # framework's base class); declared for type checkers and readers.
    rank: Any
    world_size: Any
    all_gather_into_tensor: Any
    reduce_scatter_tensor: Any
    all_to_all_single: Any
    cat: Any
    split: Any
    narrow: Any
    pad_zeros: Any
    reshape: Any
    new_empty: Any
    int_tensor: Any
    to_ints: Any

    def all_gather_sizes(self, size: int, group: Any = None) -> list[int]:
        """Every rank's ``size`` (an int), in group-rank order: one small all-gather. Use it
        before gathering pieces whose lengths only their owners know."""
        n = self.world_size(group)
        if n == 1:
            return [int(size)]
        mine = self.int_tensor([int(size)])
        out = self.new_empty(mine, (n,))
        self.all_gather_into_tensor(out, mine, group)
        return self.to_ints(out)

    def piece_along(self, tensor: Any, dim: int, group: Any = None, *,
                    sizes: Sequence[int] | None = None) -> Any:
        """This rank's piece of ``tensor`` split along ``dim`` into pieces of ``sizes``
        (default: ``torch.chunk``'s), without communication: the ``Replicate -> Shard`` step."""
        n = self.world_size(group)
        if n == 1:
            return tensor
        dim = _norm(dim, len(tensor.shape))
        full = tensor.shape[dim]
        sizes = chunk_sizes(full, n) if sizes is None else list(sizes)
        if len(sizes) != n or sum(sizes) != full:
            raise ValueError(
                f"piece_along(dim={dim}): sizes {sizes} must be {n} lengths summing to the "
                f"dim's size {full}"
            )
        me = self.rank(group)
        return self.narrow(tensor, dim, _offsets(sizes)[me], sizes[me])

    def all_gather_along(self, tensor: Any, dim: int, group: Any = None, *,
                         sizes: Sequence[int] | None = None) -> Any:
        """Every rank's ``tensor`` concatenated along ``dim`` in group-rank order.

        ``sizes[k]`` is rank ``k``'s length along ``dim`` (default: all equal to this rank's);
        the other dims must agree on every rank. Uneven pieces are padded and trimmed.
        """
        n = self.world_size(group)
        if n == 1:
            return tensor
        shape = tuple(tensor.shape)
        dim = _norm(dim, len(shape))
        mine = shape[dim]
        if sizes is None:
            step, even = mine, True
        elif len(sizes) != n or sizes[self.rank(group)] != mine:
            raise ValueError(
                f"all_gather_along(dim={dim}): sizes {list(sizes)} do not fit a group of {n} "
                f"in which this rank (index {self.rank(group)}) holds {mine}"
            )
        else:
            step = max(sizes)
            even = min(sizes) == step
        if not even:
            tensor = self.pad_zeros(tensor, dim, step)
            shape = _with(shape, dim, step)
        x = self.reshape(tensor, (-1,))
        flat = self.new_empty(x, (n * x.shape[0],))
        self.all_gather_into_tensor(flat, x, group)
        gathered = self.reshape(flat, (n * shape[0], *shape[1:]))
        if even and dim == 0:
            return gathered
        pieces = self.split(gathered, [shape[0]] * n, 0)
        if not even:
            pieces = [self.narrow(p, dim, 0, s) for p, s in zip(pieces, sizes, strict=True)]
        return self.cat(pieces, dim)

    def reduce_scatter_along(self, tensor: Any, dim: int, op: str = "sum",
                             group: Any = None, *,
                             sizes: Sequence[int] | None = None) -> Any:
        """Reduce ``tensor`` (the same shape on every rank) across ranks and keep this rank's
        piece along ``dim``. ``sizes`` are the pieces' lengths (default: ``torch.chunk``'s)."""
        n = self.world_size(group)
        if n == 1:
            return tensor
        dim = _norm(dim, len(tensor.shape))
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
        piece = _with(tensor.shape, dim, step)
        if even and dim == 0:
            stacked = self.reshape(tensor, (-1,))
        else:
            # Piece k (padded) becomes rows [k * d0, (k + 1) * d0) of one tensor: rank k's part.
            pieces = self.split(tensor, sizes, dim)
            if not even:
                pieces = [self.pad_zeros(p, dim, step) for p in pieces]
            stacked = self.reshape(self.cat(pieces, 0), (-1,))
        out = self.new_empty(stacked, (math.prod(piece),))
        self.reduce_scatter_tensor(out, stacked, op, group)
        out = self.reshape(out, piece)
        mine = sizes[self.rank(group)]
        if mine != step:
            out = self.reshape(self.narrow(out, dim, 0, mine), _with(piece, dim, mine))
        return out

    def all_to_all_along(self, tensor: Any, split_dim: int, concat_dim: int,
                         group: Any = None, *,
                         split_sizes: Sequence[int] | None = None,
                         concat_sizes: Sequence[int] | None = None) -> Any:
        """Split ``tensor`` along ``split_dim`` into pieces of ``split_sizes`` (default:
        ``torch.chunk``'s), send piece ``k`` to rank ``k``, and concatenate the pieces received
        along ``concat_dim``.

        ``concat_sizes[k]`` is rank ``k``'s length along ``concat_dim`` (default: all equal to
        this rank's); ``split_dim``'s size must be the same on every rank.
        """
        n = self.world_size(group)
        if n == 1:
            return tensor
        nd = len(tensor.shape)
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
        send = [self.reshape(p, (-1,)) for p in self.split(tensor, split, split_dim)]
        send_sizes = [math.prod(_with(tensor.shape, split_dim, s)) for s in split]
        recv_shapes = [_with(_with(tensor.shape, split_dim, split[me]), concat_dim, c)
                       for c in concat_sizes]
        out_sizes = [math.prod(s) for s in recv_shapes]
        out = self.new_empty(send[0], (sum(out_sizes),))
        self.all_to_all_single(out, self.cat(send, 0), out_sizes, send_sizes, group)
        pieces = [self.reshape(p, shape)
                  for p, shape in zip(self.split(out, out_sizes, 0), recv_shapes, strict=True)]
        return self.cat(pieces, concat_dim)
