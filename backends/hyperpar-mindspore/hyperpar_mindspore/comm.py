"""Differentiable boundary communication on MindSpore: one Cell per :class:`~hyperpar.parallel.
spec.Comm`, whose ``construct`` runs the forward op and whose ``bprop`` runs the backward op.

MindSpore has no ``Tensor.backward``; gradients flow through ``ms.grad`` / ``ms.value_and_grad``,
which honour a Cell's custom ``bprop``. The collectives along a dim are the Platform's
framework-neutral :class:`~hyperpar.platform.dim_collectives.DimCollectives` (the same code the
PyTorch platforms run), over MindSpore's collectives (composed where the target has no kernel).
"""

from __future__ import annotations

from typing import Any

from mindspore import mint, nn

from hyperpar.parallel.spec import Comm

from .platform import MindSporePlatform, MSGroup


def check_split(platform: MindSporePlatform, x: Any, dim: int, group: MSGroup,
                what: str = "") -> None:
    """Raise when dim ``dim`` of ``x`` cannot be split evenly over the group (every rank sees
    the same shapes, so every rank raises, before any collective). MindSpore's styles keep
    every piece the same size: the backward of a split gathers equal pieces."""
    n = platform.world_size(group)
    size = x.shape[dim]
    if size % n:
        at = f"{what}: " if what else ""
        raise ValueError(f"{at}cannot split dim {dim} of size {size} (shape {tuple(x.shape)}) "
                         f"evenly over {n} tensor-parallel ranks; make it divisible by {n} (a "
                         f"sequence dim: pad the sequence to a multiple of {n})")


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
        return platform.all_gather_along(x, dim, group)
    if op == "chunk":
        check_split(platform, x, dim, group, what)
        return platform.piece_along(x, dim, group)
    if op == "reduce_scatter":
        check_split(platform, x, dim, group, what)  # before the reduction, on every rank
        return platform.reduce_scatter_along(x, dim, "sum", group)
    if op == "all_to_all":
        src, dst = (dim2, dim) if backward else (dim, dim2)
        check_split(platform, x, src, group, what)
        return platform.all_to_all_along(x, src, dst, group)
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


__all__ = ["Boundary", "all_reduce_copy", "check_split", "run_op", "zeros"]
