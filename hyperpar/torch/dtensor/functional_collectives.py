"""torch's functional collectives (``torch.distributed._functional_collectives``) over hyperpar
meshes: each returns a new tensor and leaves its input alone.

torch's versions reject a hyperpar :class:`DeviceMesh`; a script whose distributed imports are
rewritten to hyperpar's imports this module in their place, e.g.
``import hyperpar.torch.dtensor.functional_collectives as funcol`` then
``funcol.all_reduce(loss, "max", group=mesh)`` (torchtitan's ``dist_max`` / ``dist_mean``).

``group`` is a 1-D mesh, ``(mesh, mesh_dim)``, an n-D mesh (its first dimension, as torch
does) or a platform group (``mesh.get_group(dim)``). The collectives run synchronously through
the platform.

Autograd follows torch's funcol (measured on torch 2.13 and 2.14.1 by
``scripts/probe_funcol_autograd.py``; table in docs/dtensor.md): ``all_reduce`` (sum),
``all_gather_*``, ``reduce_scatter_*`` (sum), ``all_to_all_single`` and their ``_autograd``
names are differentiable with the exact adjoint; a backward through a reduction torch cannot
differentiate (``max``, ``min``, ``product``) raises, as torch's does. Two differences, both
where torch's gradient is missing or wrong: ``avg`` gets its adjoint (torch raises), and
``broadcast``'s backward sums every rank's gradient into ``src`` (torch passes each rank's
gradient to its own input, silently). No collective here returns a detached result for an input
that requires grad.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hyperpar.dtensor.mesh import DeviceMesh
from hyperpar.platform import get_platform
from hyperpar.platform.base import REDUCE_OPS

__all__ = ["all_gather_single", "all_gather_single_autograd", "all_gather_tensor",
           "all_gather_tensor_autograd", "all_reduce", "all_to_all_single",
           "all_to_all_single_autograd", "broadcast", "reduce_scatter_single",
           "reduce_scatter_single_autograd", "reduce_scatter_tensor",
           "reduce_scatter_tensor_autograd", "wait_tensor"]

#: torch's reduce-op spellings -> the platform's
_OPS = {"sum": "sum", "avg": "avg", "mean": "avg", "max": "max", "min": "min",
        "product": "product", "prod": "product"}


def _group(group: Any, what: str) -> Any:
    """The platform group named by ``group`` (mesh, (mesh, dim), n-D mesh, or a group)."""
    if isinstance(group, tuple) and len(group) == 2 and isinstance(group[0], DeviceMesh):
        mesh, dim = group
        return mesh.get_group(dim)
    if isinstance(group, DeviceMesh):
        return group.get_group(0) if group.ndim > 1 else group.get_group()
    if group is None or isinstance(group, list | tuple | str):
        raise TypeError(
            f"{what}: group={group!r} is not supported; pass a hyperpar DeviceMesh, "
            f"(mesh, mesh_dim) or mesh.get_group(dim) (rank lists and group names are not)")
    return group


def _op(op: Any, what: str) -> str:
    name = str(getattr(op, "name", op)).lower()
    name = _OPS.get(name, name)
    if name not in REDUCE_OPS:
        raise ValueError(f"{what}: reduce op {op!r} is not one of {sorted(_OPS)}")
    return name


def _plain(t: Any, what: str) -> torch.Tensor:
    from hyperpar.torch.dtensor.api import DTensor

    if isinstance(t, DTensor):
        raise TypeError(f"{what}: got a DTensor; functional collectives take this rank's plain "
                        f"tensor: pass dtensor.to_local() (or dtensor.full_tensor())")
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    return t


def _grad(t: torch.Tensor) -> bool:
    """Whether the result must carry a gradient back to ``t`` (the autograd path)."""
    return t.requires_grad and torch.is_grad_enabled()


class _NoBackward(torch.autograd.Function):
    """A result torch's funcol cannot differentiate: forward passes it on, backward raises as
    torch's does (at backward, so a forward-only use still works)."""

    @staticmethod
    def forward(ctx, x, out, message):  # noqa: D102
        ctx.message = message
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        raise RuntimeError(ctx.message)


def _refuse_backward(x: torch.Tensor, out: torch.Tensor, what: str, op: str) -> torch.Tensor:
    if not _grad(x):
        return out
    return _NoBackward.apply(x, out, (
        f"{what} backward only supports 'sum' and 'avg' reductions, got {op!r} (as torch's "
        f"functional collectives); detach the input or compute this reduction's gradient "
        f"yourself"))


def all_reduce(self: torch.Tensor, reduceOp: Any, group: Any, tag: str = "") -> torch.Tensor:  # noqa: N803 -- torch's name
    """The reduction (``"sum"``, ``"avg"``, ``"max"``, ...) of every rank's ``self``.
    Differentiable for ``sum`` and ``avg`` (backward: the same all-reduce of the gradients)."""
    x = _plain(self, "all_reduce")
    op, g = _op(reduceOp, "all_reduce"), _group(group, "all_reduce")
    platform = get_platform()
    if op in ("sum", "avg"):
        return platform.all_reduce_autograd(x.contiguous(), op, g)
    out = x.detach().contiguous().clone()
    platform.all_reduce(out, op, g)
    return _refuse_backward(x, out, "all_reduce", op)


def all_gather_single(self: torch.Tensor, gather_dim: int, group: Any,
                      tag: str = "") -> torch.Tensor:
    """Every rank's ``self`` concatenated along ``gather_dim`` in group-rank order.
    Differentiable: backward reduce-scatters (sum) the gradient."""
    x = _plain(self, "all_gather_tensor")
    if not x.dim():
        raise ValueError("all_gather_tensor: a 0-d tensor has no dim to gather along")
    return get_platform().all_gather_autograd(x.contiguous(), gather_dim % x.dim(),
                                              _group(group, "all_gather_tensor"))


def reduce_scatter_single(self: torch.Tensor, reduceOp: Any, scatter_dim: int, group: Any,  # noqa: N803
                          tag: str = "") -> torch.Tensor:
    """The reduction of every rank's ``self``, split along ``scatter_dim``: this rank's part.
    Differentiable for ``sum`` and ``avg`` (backward: all-gather of the gradient)."""
    x = _plain(self, "reduce_scatter_tensor")
    g = _group(group, "reduce_scatter_tensor")
    op = _op(reduceOp, "reduce_scatter_tensor")
    platform = get_platform()
    n = platform.world_size(g)
    if not x.dim():
        raise ValueError("reduce_scatter_tensor: a 0-d tensor has no dim to scatter along")
    scatter_dim %= x.dim()
    if x.shape[scatter_dim] % n:
        raise ValueError(f"reduce_scatter_tensor: dim {scatter_dim} of size "
                         f"{x.shape[scatter_dim]} does not split evenly over {n} ranks")
    if op in ("sum", "avg"):
        return platform.reduce_scatter_autograd(x.contiguous(), scatter_dim, op, g)
    y = x.detach()
    if scatter_dim:
        y = torch.cat(y.chunk(n, dim=scatter_dim), dim=0)
    y = y.contiguous()
    out = y.new_empty((y.shape[0] // n, *y.shape[1:]))
    # dim-0 block i of y is chunk i along scatter_dim: rank i receives exactly that chunk
    platform.reduce_scatter_tensor(out, y, op, g)
    return _refuse_backward(x, out, "reduce_scatter_tensor", op)


def all_to_all_single(self: torch.Tensor, output_split_sizes: Sequence[int] | None,
                      input_split_sizes: Sequence[int] | None, group: Any,
                      tag: str = "") -> torch.Tensor:
    """Dim-0 slices exchanged between ranks: ``input_split_sizes[j]`` rows go to group rank
    ``j``, ``output_split_sizes[j]`` rows arrive from it (both None: equal pieces).
    Differentiable, as torch's: backward is the same exchange with the split lists swapped."""
    x = _plain(self, "all_to_all_single")
    if (output_split_sizes is None) != (input_split_sizes is None):
        raise ValueError("all_to_all_single: output_split_sizes and input_split_sizes must "
                         "both be given or both be None")
    return get_platform().all_to_all_single_autograd(
        x, output_split_sizes, input_split_sizes, _group(group, "all_to_all_single"))


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, platform, src, group):  # noqa: D102
        ctx.platform, ctx.src, ctx.group = platform, src, group
        out = x.detach().contiguous().clone()
        platform.broadcast(out, src, group)
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        # the adjoint of a copy from src to every rank: src's input receives the sum of all
        # ranks' gradients, the others' inputs did not reach the output
        grad = grad.contiguous().clone()
        ctx.platform.all_reduce(grad, "sum", ctx.group)
        if ctx.platform.rank() != ctx.src:
            grad.zero_()
        return grad, None, None, None


def broadcast(self: torch.Tensor, src: int, group: Any, tag: str = "") -> torch.Tensor:
    """Global rank ``src``'s ``self`` on every rank. Differentiable: ``src``'s input gets the
    sum of every rank's gradient, the others zero."""
    x = _plain(self, "broadcast")
    return _Broadcast.apply(x, get_platform(), src, _group(group, "broadcast"))


def wait_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """These collectives complete before they return: waiting is the identity (and so is its
    gradient, as torch's)."""
    return tensor


#: torch's names for the same collectives: the ``_autograd`` ones and the ``_tensor`` spellings
#: (torch 2.13 deprecated ``*_tensor`` for ``*_single``; both stay in torch and here) all
#: differentiate, as torch's do since 2.13
all_gather_tensor = all_gather_single
all_gather_single_autograd = all_gather_single
all_gather_tensor_autograd = all_gather_single
reduce_scatter_tensor = reduce_scatter_single
reduce_scatter_single_autograd = reduce_scatter_single
reduce_scatter_tensor_autograd = reduce_scatter_single
all_to_all_single_autograd = all_to_all_single
