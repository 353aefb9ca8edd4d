"""Differentiable boundary communication on MindSpore: one Cell per :class:`~hyperpar.parallel.
spec.Comm`, whose ``construct`` runs the forward op and whose ``bprop`` runs the backward op.

MindSpore has no ``Tensor.backward``; gradients flow through ``ms.grad`` / ``ms.value_and_grad``,
which honour a Cell's custom ``bprop``. The collectives are the Platform's (composed where the
target has no kernel), applied along any dim.
"""

from __future__ import annotations

from typing import Any

from mindspore import mint, nn

from hyperpar.parallel.spec import Comm

from .platform import MindSporePlatform, MSGroup


def all_gather_along(platform: MindSporePlatform, x: Any, dim: int, group: MSGroup) -> Any:
    """Every rank's ``x`` concatenated along ``dim`` in group-rank order (equal shapes)."""
    return mint.cat(platform.gather_list(x, group, "all_gather"), dim)


def check_split(platform: MindSporePlatform, x: Any, dim: int, group: MSGroup,
                what: str = "") -> None:
    """Raise when dim ``dim`` of ``x`` cannot be split evenly over the group (every rank sees
    the same shapes, so every rank raises, before any collective)."""
    n = platform.world_size(group)
    size = x.shape[dim]
    if size % n:
        at = f"{what}: " if what else ""
        raise ValueError(f"{at}cannot split dim {dim} of size {size} (shape {tuple(x.shape)}) "
                         f"evenly over {n} tensor-parallel ranks; make it divisible by {n} (a "
                         f"sequence dim: pad the sequence to a multiple of {n})")


def piece_along(platform: MindSporePlatform, x: Any, dim: int, group: MSGroup,
                what: str = "") -> Any:
    """This rank's piece of ``x`` split evenly along ``dim`` (no communication)."""
    check_split(platform, x, dim, group, what)
    n, me = platform.world_size(group), platform.rank(group)
    size = x.shape[dim] // n
    return mint.narrow(x, dim, me * size, size).copy()


def all_reduce_copy(platform: MindSporePlatform, x: Any, group: MSGroup) -> Any:
    """The sum over ranks of ``x``, out of place."""
    y = x.copy()
    platform.all_reduce(y, "sum", group)
    return y


def run_op(platform: MindSporePlatform, op: str, x: Any, comm: Comm, group: MSGroup,
           backward: bool = False, what: str = "") -> Any:
    """Apply one op of ``comm`` to ``x``."""
    dim, dim2 = comm.dim, comm.dim2
    if op == "none":
        return x
    if op == "all_reduce":
        return all_reduce_copy(platform, x, group)
    if op == "all_gather":
        return all_gather_along(platform, x, dim, group)
    if op == "chunk":
        return piece_along(platform, x, dim, group, what)
    if op == "reduce_scatter":
        check_split(platform, x, dim, group, what)  # before the reduction, on every rank
        return piece_along(platform, all_reduce_copy(platform, x, group), dim, group, what)
    if op == "all_to_all":
        src, dst = (dim2, dim) if backward else (dim, dim2)
        me = platform.rank(group)
        n = platform.world_size(group)
        # Composed: gather every rank's tensor, keep piece `me` (along src) of each, concatenate.
        pieces = []
        for data in platform.gather_list(x, group, "all_to_all"):
            size = data.shape[src] // n
            pieces.append(mint.narrow(data, src, me * size, size).copy())
        return mint.cat(pieces, dst)
    raise ValueError(f"unknown boundary op {op!r}")


class Boundary(nn.Cell):
    """``comm.forward`` in ``construct``, ``comm.backward`` on the gradient in ``bprop``."""

    def __init__(self, platform: MindSporePlatform, comm: Comm, group: MSGroup,
                 what: str = "") -> None:
        super().__init__()
        self.platform, self.comm, self.group = platform, comm, group
        self.what = what  # names the boundary in errors ("ColwiseParallel input")

    def construct(self, x: Any) -> Any:
        return run_op(self.platform, self.comm.forward, x, self.comm, self.group,
                      what=self.what)

    def bprop(self, x: Any, out: Any, dout: Any) -> tuple[Any]:
        return (run_op(self.platform, self.comm.backward, dout, self.comm, self.group, True,
                       self.what),)


def zeros(shape: tuple[int, ...], dtype: Any) -> Any:
    """A zero tensor (``mint.zeros_like`` has no CPU kernel in MindSpore 2.10)."""
    return mint.zeros(tuple(shape), dtype=dtype)


__all__ = ["Boundary", "all_gather_along", "all_reduce_copy", "check_split", "piece_along",
           "run_op", "zeros"]
