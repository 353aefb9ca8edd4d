"""torch's functional collectives (``torch.distributed._functional_collectives``) over hyperpar
meshes: each returns a new tensor and leaves its input alone.

torch's versions reject a hyperpar :class:`DeviceMesh`; a script whose distributed imports are
rewritten to hyperpar's imports this module in their place, e.g.
``import hyperpar.torch.dtensor.functional_collectives as funcol`` then
``funcol.all_reduce(loss, "max", group=mesh)`` (torchtitan's ``dist_max`` / ``dist_mean``).

``group`` is a 1-D mesh, ``(mesh, mesh_dim)``, an n-D mesh (its first dimension, as torch
does) or a platform group (``mesh.get_group(dim)``). The collectives run synchronously through
the platform and are not differentiable (torch's are not either, except under its own tracer).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hyperpar.dtensor.mesh import DeviceMesh
from hyperpar.platform import get_platform
from hyperpar.platform.base import REDUCE_OPS

__all__ = ["all_gather_tensor", "all_reduce", "all_to_all_single", "broadcast",
           "reduce_scatter_tensor", "wait_tensor"]

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
    return t.detach().contiguous().clone()


def all_reduce(self: torch.Tensor, reduceOp: Any, group: Any, tag: str = "") -> torch.Tensor:  # noqa: N803 -- torch's name
    """The reduction (``"sum"``, ``"avg"``, ``"max"``, ...) of every rank's ``self``."""
    out = _plain(self, "all_reduce")
    get_platform().all_reduce(out, _op(reduceOp, "all_reduce"), _group(group, "all_reduce"))
    return out


def all_gather_tensor(self: torch.Tensor, gather_dim: int, group: Any,
                      tag: str = "") -> torch.Tensor:
    """Every rank's ``self`` concatenated along ``gather_dim`` in group-rank order."""
    x = _plain(self, "all_gather_tensor")
    g = _group(group, "all_gather_tensor")
    platform = get_platform()
    n = platform.world_size(g)
    if not x.dim():
        raise ValueError("all_gather_tensor: a 0-d tensor has no dim to gather along")
    out = x.new_empty((n * x.shape[0], *x.shape[1:]))
    platform.all_gather_into_tensor(out, x, g)
    if gather_dim % x.dim() != 0:
        out = torch.cat(out.chunk(n, dim=0), dim=gather_dim)
    return out


def reduce_scatter_tensor(self: torch.Tensor, reduceOp: Any, scatter_dim: int, group: Any,  # noqa: N803
                          tag: str = "") -> torch.Tensor:
    """The reduction of every rank's ``self``, split along ``scatter_dim``: this rank's part."""
    x = _plain(self, "reduce_scatter_tensor")
    g = _group(group, "reduce_scatter_tensor")
    platform = get_platform()
    n = platform.world_size(g)
    if x.shape[scatter_dim] % n:
        raise ValueError(f"reduce_scatter_tensor: dim {scatter_dim} of size "
                         f"{x.shape[scatter_dim]} does not split evenly over {n} ranks")
    if scatter_dim % x.dim() != 0:
        x = torch.cat(x.chunk(n, dim=scatter_dim), dim=0).contiguous()
    out = x.new_empty((x.shape[0] // n, *x.shape[1:]))
    # dim-0 block i of x is now chunk i along scatter_dim: rank i receives exactly that chunk
    platform.reduce_scatter_tensor(out, x, _op(reduceOp, "reduce_scatter_tensor"), g)
    return out


def all_to_all_single(self: torch.Tensor, output_split_sizes: Sequence[int] | None,
                      input_split_sizes: Sequence[int] | None, group: Any,
                      tag: str = "") -> torch.Tensor:
    """Dim-0 slices exchanged between ranks (see ``Platform.all_to_all_single``)."""
    x = _plain(self, "all_to_all_single")
    g = _group(group, "all_to_all_single")
    rows = sum(output_split_sizes) if output_split_sizes is not None else x.shape[0]
    out = x.new_empty((rows, *x.shape[1:]))
    get_platform().all_to_all_single(out, x, output_split_sizes, input_split_sizes, g)
    return out


def broadcast(self: torch.Tensor, src: int, group: Any, tag: str = "") -> torch.Tensor:
    """Global rank ``src``'s ``self`` on every rank."""
    out = _plain(self, "broadcast")
    get_platform().broadcast(out, src, _group(group, "broadcast"))
    return out


def wait_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """These collectives complete before they return: waiting is the identity."""
    return tensor
