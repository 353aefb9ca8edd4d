"""Differentiable boundary communication on MindSpore: one Cell per :class:`~hyperpar.parallel.
spec.Comm`, whose ``construct`` runs the forward op and whose ``bprop`` runs the backward op.

MindSpore has no ``Tensor.backward``; gradients flow through ``ms.grad`` / ``ms.value_and_grad``,
which honour a Cell's custom ``bprop``. The collectives along a dim are the Platform's
framework-neutral :class:`~hyperpar.platform.dim_collectives.DimCollectives` (the same code the
PyTorch platforms run), over MindSpore's collectives (composed where the target has no kernel);
this module adds only what MindSpore's kernels need checked first (no empty pieces).
"""

from __future__ import annotations

from typing import Any

from mindspore import mint, nn

from hyperpar.dtensor.layout import check_chunk_split
from hyperpar.parallel.spec import Comm, check_no_empty_piece
from hyperpar.platform.base import Platform
from hyperpar.platform.dim_collectives import chunk_sizes

from .collectives import MSGroup
from .tensors import copy_tensor


def lengths_along(platform: Platform, x: Any, dim: int, group: MSGroup,
                  what: str = "") -> list[int]:
    """Every rank's length of ``x`` along ``dim`` (one small all-gather). They must be
    ``torch.chunk``'s split of their sum, else every rank raises the same error."""
    n = platform.world_size(group)
    mine = int(x.shape[dim])
    if n == 1:
        return [mine]
    lengths = platform.all_gather_sizes(mine, group)
    check_chunk_split(lengths, dim, what)
    return lengths


def all_gather_along(platform: Platform, x: Any, dim: int, group: MSGroup,
                     sizes: list[int] | None = None, what: str = "") -> Any:
    """Every rank's ``x`` concatenated along ``dim`` in group-rank order. ``sizes``: each
    rank's length along ``dim`` (exchanged and checked when not given); uneven pieces travel
    padded (the platform's :meth:`~hyperpar.platform.dim_collectives.DimCollectives.
    all_gather_along`)."""
    dim %= x.ndim
    if sizes is None:
        sizes = lengths_along(platform, x, dim, group, what)
    return platform.all_gather_along(x, dim, group, sizes=sizes)


#: who cannot compute on an empty piece (named in :func:`check_no_empty_piece`'s error)
KERNELS = "MindSpore's kernels"


def piece_along(platform: Platform, x: Any, dim: int, group: MSGroup,
                what: str = "") -> Any:
    """This rank's ``torch.chunk`` piece of ``x`` along ``dim`` (no communication)."""
    dim %= x.ndim
    n = platform.world_size(group)
    check_no_empty_piece(int(x.shape[dim]), n, dim, tuple(x.shape), what, KERNELS)
    piece = platform.piece_along(x, dim, group)
    # a view would keep the whole buffer alive and MindSpore slices are copies anyway
    return piece if piece is x else copy_tensor(piece)


def all_reduce_copy(platform: Platform, x: Any, group: MSGroup) -> Any:
    """The sum over ranks of ``x``, out of place."""
    y = copy_tensor(x)
    platform.all_reduce(y, "sum", group)
    return y


def all_to_all_along(platform: Platform, x: Any, sharded: int, to: int,
                     group: MSGroup, what: str = "") -> Any:
    """Re-shard ``x`` from ``Shard(sharded)`` to ``Shard(to)``: keep this rank's piece along
    ``to`` of every rank's ``x``, concatenated along ``sharded`` (composed: all-gather, then
    select; uneven pieces as ``torch.chunk`` makes them)."""
    sharded %= x.ndim
    to %= x.ndim
    sizes = lengths_along(platform, x, sharded, group, what)
    whole = all_gather_along(platform, x, sharded, group, sizes, what)
    return piece_along(platform, whole, to, group, what)


def run_op(platform: Platform, op: str, x: Any, comm: Comm, group: MSGroup,
           backward: bool = False, what: str = "", full: int | None = None) -> Any:
    """Apply one op of ``comm`` to ``x``. ``full``: the global length along ``comm.dim`` when
    the caller knows it (a gather then needs no exchange of lengths)."""
    dim, dim2 = comm.dim, comm.dim2
    n = platform.world_size(group)
    if op == "none":
        return x
    if op == "all_reduce":
        return all_reduce_copy(platform, x, group)
    if op == "all_gather":
        sizes = chunk_sizes(full, n) if full is not None else None
        return all_gather_along(platform, x, dim, group, sizes, what)
    if op == "chunk":
        return piece_along(platform, x, dim, group, what)
    if op == "reduce_scatter":
        return piece_along(platform, all_reduce_copy(platform, x, group), dim, group, what)
    if op == "all_to_all":  # comm: Shard(dim) -> Shard(dim2); backward the other way
        src, dst = (dim2, dim) if backward else (dim, dim2)
        return all_to_all_along(platform, x, src, dst, group, what)
    raise ValueError(f"unknown boundary op {op!r}")


class Boundary(nn.Cell):
    """``comm.forward`` in ``construct``, ``comm.backward`` on the gradient in ``bprop``.

    ``full``: the global length along ``comm.dim`` of a forward all-gather, when known (a
    weight's size); a backward all-gather knows it from the forward input."""

    def __init__(self, platform: Platform, comm: Comm, group: MSGroup,
                 what: str = "", full: int | None = None) -> None:
        super().__init__()
        self.platform, self.comm, self.group = platform, comm, group
        self.what = what  # names the boundary in errors ("ColwiseParallel input")
        self.full = full

    def construct(self, x: Any) -> Any:
        return run_op(self.platform, self.comm.forward, x, self.comm, self.group,
                      what=self.what, full=self.full)

    def bprop(self, x: Any, out: Any, dout: Any) -> tuple[Any]:
        full = None
        if self.comm.backward == "all_gather":  # the adjoint of a chunk: x was whole
            full = int(x.shape[self.comm.dim % x.ndim])
        return (run_op(self.platform, self.comm.backward, dout, self.comm, self.group, True,
                       self.what, full),)


def zeros(shape: tuple[int, ...], dtype: Any) -> Any:
    """A zero tensor (``mint.zeros_like`` has no CPU kernel in MindSpore 2.10)."""
    return mint.zeros(tuple(shape), dtype=dtype)


__all__ = ["Boundary", "all_gather_along", "all_reduce_copy", "all_to_all_along",
           "lengths_along", "piece_along", "run_op",
           "zeros"]
