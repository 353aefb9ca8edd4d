"""DeviceMesh on MindSpore: ranks laid out in an n-D grid with named dims, one process group per
line of the grid. The call forms of hyperpar's (and torch's) ``init_device_mesh``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from hyperpar.platform import get_platform

from .platform import MSGroup


class DeviceMesh:
    """An n-D grid of global ranks. ``mesh["tp"]`` is the 1-D mesh along dim ``"tp"`` that holds
    this rank; ``get_group(dim)`` its process group."""

    def __init__(self, ranks: np.ndarray, mesh_dim_names: Sequence[str] | None,
                 groups: dict[int, MSGroup]) -> None:
        self.mesh = ranks
        self.mesh_dim_names = tuple(mesh_dim_names) if mesh_dim_names else None
        self._groups = groups

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.mesh.shape)

    @property
    def ndim(self) -> int:
        return self.mesh.ndim

    def size(self, dim: int | None = None) -> int:
        """Ranks in the mesh, or along ``dim``."""
        return int(self.mesh.size if dim is None else self.mesh.shape[dim])

    def _dim(self, dim: int | str) -> int:
        if isinstance(dim, str):
            if not self.mesh_dim_names or dim not in self.mesh_dim_names:
                raise KeyError(f"mesh has no dim named {dim!r}; its dims are "
                               f"{self.mesh_dim_names or '(unnamed)'}")
            return self.mesh_dim_names.index(dim)
        if not -self.ndim <= dim < self.ndim:
            raise IndexError(f"mesh dim {dim} out of range for a {self.ndim}-D mesh")
        return dim % self.ndim

    def get_group(self, dim: int | str = 0) -> MSGroup:
        """The process group along ``dim`` that contains this rank."""
        return self._groups[self._dim(dim)]

    def get_local_rank(self, dim: int | str = 0) -> int:
        """This rank's coordinate along ``dim``."""
        return get_platform().rank(self.get_group(dim))

    def get_mesh(self, mesh_dim: int | str | None = None, *, default: str | None = None
                 ) -> DeviceMesh:
        """The 1-D mesh along ``mesh_dim`` (a name or an index) holding this rank; with
        ``mesh_dim=None`` a 1-D mesh is itself and an n-D one takes the dim named ``default``
        (hyperpar's ``DeviceMesh.get_mesh``)."""
        if mesh_dim is None:
            if self.ndim == 1:
                return self
            if default is None or not self.mesh_dim_names or default not in self.mesh_dim_names:
                raise ValueError(f"{self} has {self.ndim} dims and none is named "
                                 f"{default!r}; pass tp_mesh_dim= or name a dim {default!r}")
            mesh_dim = default
        if isinstance(mesh_dim, str) and self.ndim == 1 and not self.mesh_dim_names:
            return self  # an unnamed 1-D mesh answers to any name
        d = self._dim(mesh_dim)
        group = self._groups[d]
        names = (self.mesh_dim_names[d],) if self.mesh_dim_names else None
        return DeviceMesh(np.array(group.ranks), names, {0: group})

    def __getitem__(self, name: str) -> DeviceMesh:
        d = self._dim(name)
        group = self._groups[d]
        names = (self.mesh_dim_names[d],) if self.mesh_dim_names else None
        return DeviceMesh(np.array(group.ranks), names, {0: group})

    def __repr__(self) -> str:
        names = f", mesh_dim_names={self.mesh_dim_names}" if self.mesh_dim_names else ""
        return f"DeviceMesh({self.mesh.tolist()}{names})"


def init_device_mesh(*args: Any, mesh_dim_names: Sequence[str] | None = None) -> DeviceMesh:
    """``init_device_mesh((2, 2), mesh_dim_names=("dp", "tp"))`` -- or torch's form with a
    device type first, ``init_device_mesh("cpu", (2,))`` (the device comes from the backend).

    Joins the world group if needed. Every rank must call it with the same shape."""
    if args and isinstance(args[0], str):
        args = args[1:]
    if len(args) != 1:
        raise TypeError("init_device_mesh takes the mesh shape, e.g. init_device_mesh((2,), "
                        "mesh_dim_names=('tp',))")
    shape = tuple(int(s) for s in args[0])
    platform = get_platform()
    if not platform.is_initialized():
        platform.init_process_group()
    world = platform.world_size()
    if int(np.prod(shape)) != world or min(shape, default=0) < 1:
        raise ValueError(f"mesh shape {shape} holds {int(np.prod(shape))} ranks but the world "
                         f"has {world}; pick a shape whose product is {world}")
    if mesh_dim_names is not None and len(mesh_dim_names) != len(shape):
        raise ValueError(f"mesh_dim_names {tuple(mesh_dim_names)} names {len(mesh_dim_names)} "
                         f"dims but the shape {shape} has {len(shape)}")
    grid = np.arange(world).reshape(shape)
    me = platform.rank()
    groups = {}
    for d in range(len(shape)):
        lines = np.moveaxis(grid, d, -1).reshape(-1, shape[d])
        for line in lines:  # every rank creates every group, in the same order
            group = platform.new_group([int(r) for r in line])
            if me in group.ranks:
                groups[d] = group
    return DeviceMesh(grid, mesh_dim_names, groups)
