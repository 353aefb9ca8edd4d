"""DeviceMesh: an n-dimensional arrangement of global ranks, with one process group per
mesh dimension obtained through the Platform (never torch's collective module directly)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from hyperpar.platform import get_platform

_MESH_STACK: list[DeviceMesh] = []


def _slices(mesh: torch.Tensor, dims: Sequence[int]) -> list[tuple[int, ...]]:
    """Every rank list obtained by walking ``dims`` (row-major) with the other dims fixed, in a
    deterministic order that is the same on every rank."""
    others = [d for d in range(mesh.ndim) if d not in dims]
    moved = mesh.permute(*others, *dims).reshape(-1, math.prod(mesh.shape[d] for d in dims))
    return [tuple(int(r) for r in row) for row in moved.tolist()]


class DeviceMesh:
    """An n-D grid of global ranks with named dimensions.

    Build one with :func:`init_device_mesh`. ``mesh["tp"]`` or ``mesh["dp", "tp"]`` slice it to
    the sub-mesh containing this rank; :meth:`flatten` merges several dims into one. Each mesh
    dimension has a process group (``get_group(dim)``), created once per rank list and shared
    by every mesh that uses that rank list.
    """

    def __init__(self, device_type: str | None, mesh: Any, *,
                 mesh_dim_names: Sequence[str] | None = None, _groups: list[Any] | None = None,
                 _root: DeviceMesh | None = None, _root_dims: tuple[int, ...] | None = None
                 ) -> None:
        platform = get_platform()
        self.device_type = device_type or platform.device_type
        self.mesh = torch.as_tensor(mesh, dtype=torch.int64)
        if self.mesh.ndim == 0:
            self.mesh = self.mesh.reshape(1)
        names = tuple(mesh_dim_names) if mesh_dim_names is not None else None
        if names is not None:
            if len(names) != self.mesh.ndim:
                raise ValueError(
                    f"mesh_dim_names {names} has {len(names)} names for a {self.mesh.ndim}-D "
                    f"mesh of shape {tuple(self.mesh.shape)}"
                )
            dup = sorted({n for n in names if names.count(n) > 1})
            if dup:
                raise ValueError(f"mesh_dim_names {names} repeats {dup}; names must be unique")
        self.mesh_dim_names = names
        flat = [int(r) for r in self.mesh.reshape(-1).tolist()]
        if len(set(flat)) != len(flat):
            raise ValueError(f"mesh {self.mesh.tolist()} lists a rank twice")
        self._root = _root if _root is not None else self
        self._root_dims = _root_dims if _root_dims is not None else tuple(range(self.mesh.ndim))
        self._flattened: dict[str, DeviceMesh] = {}
        rank = platform.rank()
        self._rank = rank
        hits = (self.mesh == rank).nonzero()
        self._coordinate = [int(c) for c in hits[0].tolist()] if len(hits) else None
        self._shape = tuple(int(s) for s in self.mesh.shape)
        self._key = (self.device_type, tuple(flat), self._shape, names)
        self._hash = hash(self._key)
        if _groups is not None:
            self._groups = list(_groups)
        else:
            # Collective: every rank creates every group of every dim, in the same order.
            self._groups = []
            for dim in range(self.mesh.ndim):
                mine = None
                for ranks in _slices(self.mesh, [dim]):
                    group = platform.new_group(list(ranks))
                    if rank in ranks:
                        mine = group
                self._groups.append(mine)
        self._group_ranks = [self._dim_ranks(d) for d in range(self.mesh.ndim)]

    # -------------------------------------------------------------- identity
    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, DeviceMesh) and self._key == other._key)

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        names = f", mesh_dim_names={self.mesh_dim_names}" if self.mesh_dim_names else ""
        return f"DeviceMesh({self.device_type!r}, {self.mesh.tolist()}{names})"

    # -------------------------------------------------------------- shape
    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    def size(self, mesh_dim: int | str | None = None) -> int:
        """Number of ranks in the mesh, or along ``mesh_dim`` (index or name)."""
        if mesh_dim is None:
            return math.prod(self._shape)
        return self._shape[self._dim(mesh_dim)]

    def _dim(self, mesh_dim: int | str) -> int:
        if isinstance(mesh_dim, str):
            if not self.mesh_dim_names or mesh_dim not in self.mesh_dim_names:
                raise KeyError(
                    f"mesh has no dimension named {mesh_dim!r}; its dimensions are "
                    f"{self.mesh_dim_names or '(unnamed)'}"
                )
            return self.mesh_dim_names.index(mesh_dim)
        if not -self.ndim <= mesh_dim < self.ndim:
            raise IndexError(f"mesh dimension {mesh_dim} out of range for a {self.ndim}-D mesh")
        return mesh_dim % self.ndim

    # -------------------------------------------------------------- ranks and groups
    def get_rank(self) -> int:
        """This process's global rank."""
        return self._rank

    def get_coordinate(self) -> list[int] | None:
        """This rank's coordinate in the mesh, or ``None`` if it is not part of it."""
        return None if self._coordinate is None else list(self._coordinate)

    def get_local_rank(self, mesh_dim: int | str | None = None) -> int:
        """This rank's index along ``mesh_dim`` (may be omitted on a 1-D mesh)."""
        if mesh_dim is None:
            if self.ndim != 1:
                raise ValueError(f"get_local_rank() needs mesh_dim on a {self.ndim}-D mesh")
            mesh_dim = 0
        if self._coordinate is None:
            raise RuntimeError(f"rank {self._rank} is not part of {self!r}")
        return self._coordinate[self._dim(mesh_dim)]

    def get_group(self, mesh_dim: int | str | None = None) -> Any:
        """The process group of ``mesh_dim`` containing this rank (may be omitted on 1-D)."""
        if mesh_dim is None:
            if self.ndim != 1:
                raise ValueError(
                    f"get_group() needs mesh_dim on a {self.ndim}-D mesh (or use get_all_groups())"
                )
            mesh_dim = 0
        return self._groups[self._dim(mesh_dim)]

    def get_all_groups(self) -> list[Any]:
        return list(self._groups)

    def _dim_ranks(self, dim: int) -> tuple[int, ...]:
        if self._coordinate is None:
            return ()
        index: list[Any] = list(self._coordinate)
        index[dim] = slice(None)
        return tuple(int(r) for r in self.mesh[tuple(index)].reshape(-1).tolist())

    def group_ranks(self, mesh_dim: int | str) -> tuple[int, ...]:
        """Global ranks of the group of ``mesh_dim`` that contains this rank."""
        return self._group_ranks[self._dim(mesh_dim)]

    # -------------------------------------------------------------- slicing
    def __getitem__(self, names: str | Sequence[str]) -> DeviceMesh:
        if isinstance(names, str):
            names = (names,)
        names = tuple(names)
        if not self.mesh_dim_names:
            raise KeyError("cannot slice a mesh without mesh_dim_names; pass mesh_dim_names=")
        if len(set(names)) != len(names):
            raise KeyError(f"mesh slice {names} repeats a dimension name")
        if names == self.mesh_dim_names:
            return self
        root = self._root
        if len(names) == 1 and names[0] in root._flattened:
            return root._flattened[names[0]]
        for name in names:
            if name not in self.mesh_dim_names:
                flat = sorted(root._flattened)
                raise KeyError(
                    f"mesh has no dimension named {name!r}; its dimensions are "
                    f"{self.mesh_dim_names}" + (f", flattened: {flat}" if flat else "")
                )
        dims = [self.mesh_dim_names.index(n) for n in names]
        if self._coordinate is None:
            raise RuntimeError(f"rank {self._rank} is not part of {self!r}; cannot slice it")
        index: list[Any] = list(self._coordinate)
        for d in dims:
            index[d] = slice(None)
        sub = self.mesh[tuple(index)]  # kept dims, in original order
        kept = sorted(dims)
        sub = sub.permute(*[kept.index(d) for d in dims])
        return DeviceMesh(self.device_type, sub, mesh_dim_names=names,
                          _groups=[self._groups[d] for d in dims], _root=root,
                          _root_dims=tuple(self._root_dims[d] for d in dims))

    def flatten(self, mesh_dim_name: str | None = None) -> DeviceMesh:
        """A 1-D mesh whose single dimension walks every dim of this mesh (row-major).

        Collective over the world: every rank must call it. The result is also reachable from
        the root mesh as ``root[mesh_dim_name]`` (default name: the names joined by ``_``)."""
        if mesh_dim_name is None:
            mesh_dim_name = "_".join(self.mesh_dim_names or [str(d) for d in range(self.ndim)])
        root = self._root
        if mesh_dim_name in root._flattened:
            return root._flattened[mesh_dim_name]
        if root.mesh_dim_names and mesh_dim_name in root.mesh_dim_names:
            raise ValueError(f"flatten: name {mesh_dim_name!r} is already a mesh dimension")
        platform = get_platform()
        # The order of _root_dims may differ from the root order: walk them as given.
        mine = None
        for ranks in _slices(root.mesh, list(self._root_dims)):
            group = platform.new_group(list(ranks))
            if self._rank in ranks:
                mine = group
        flat = DeviceMesh(self.device_type, self.mesh.reshape(-1),
                          mesh_dim_names=(mesh_dim_name,), _groups=[mine], _root=root,
                          _root_dims=None)
        root._flattened[mesh_dim_name] = flat
        return flat

    _flatten = flatten  # torch's spelling

    # -------------------------------------------------------------- current mesh
    def __enter__(self) -> DeviceMesh:
        _MESH_STACK.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _MESH_STACK.pop()


def current_mesh() -> DeviceMesh | None:
    """The innermost mesh entered with ``with mesh:``, or ``None``."""
    return _MESH_STACK[-1] if _MESH_STACK else None


def _require_mesh(mesh: DeviceMesh | None, what: str) -> DeviceMesh:
    mesh = mesh if mesh is not None else current_mesh()
    if mesh is None:
        raise ValueError(f"{what}: no device_mesh given and no mesh is current (use `with mesh:`)")
    return mesh


def init_device_mesh(device_type: str | None = None, mesh_shape: Sequence[int] | int = (),
                     *, mesh_dim_names: Sequence[str] | None = None) -> DeviceMesh:
    """Create a mesh of shape ``mesh_shape`` over every rank of the world (row-major).

    ``device_type`` defaults to the selected backend's. Accepts both
    ``init_device_mesh((2, 2), mesh_dim_names=...)`` and torch's
    ``init_device_mesh(device_type, (2, 2), mesh_dim_names=...)``.
    """
    if not isinstance(device_type, str | None):
        device_type, mesh_shape = None, device_type  # init_device_mesh((2, 2), ...)
    if isinstance(mesh_shape, int):
        mesh_shape = (mesh_shape,)
    mesh_shape = tuple(int(s) for s in mesh_shape)
    if not mesh_shape or any(s < 1 for s in mesh_shape):
        raise ValueError(f"init_device_mesh: mesh_shape must be positive sizes, got {mesh_shape}")
    platform = get_platform()
    if not platform.is_initialized():
        raise RuntimeError(
            "init_device_mesh: the process group is not initialised; launch with "
            "`hyperpar run -n N script.py` and call get_platform().init_process_group() first"
        )
    world = platform.world_size()
    if math.prod(mesh_shape) != world:
        raise ValueError(
            f"init_device_mesh: mesh shape {mesh_shape} holds {math.prod(mesh_shape)} ranks but "
            f"the world has {world}; the product of mesh_shape must equal the world size"
        )
    if mesh_dim_names is not None and len(mesh_dim_names) != len(mesh_shape):
        raise ValueError(
            f"init_device_mesh: {len(mesh_dim_names)} mesh_dim_names {tuple(mesh_dim_names)} "
            f"for a {len(mesh_shape)}-D mesh_shape {mesh_shape}"
        )
    grid = torch.arange(world, dtype=torch.int64).reshape(mesh_shape)
    return DeviceMesh(device_type, grid, mesh_dim_names=mesh_dim_names)
