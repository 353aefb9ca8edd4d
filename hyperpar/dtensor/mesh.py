"""DeviceMesh: an n-dimensional arrangement of global ranks, with one process group per
mesh dimension obtained through the Platform (never a framework's collective module directly).

Framework-neutral: the rank grid is plain Python (a shape and the ranks in row-major order), so
one class serves PyTorch and MindSpore. ``mesh.mesh`` -- the grid as a framework tensor, which
torch code (torchtitan, ...) reads -- is built on first use by ``Platform.rank_tensor``."""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Mapping, Sequence
from typing import Any, overload

from hyperpar.platform import Platform, backends, get_platform
from hyperpar.platform.base import Group

__all__ = ["DeviceMesh", "MeshDimError", "current_mesh", "init_device_mesh"]

_MESH_STACK: list[DeviceMesh] = []

#: a mesh dimension: its name or its index
MeshDim = str | int


class MeshDimError(KeyError, ValueError):
    """A mesh dimension (name or index) that the mesh does not have. A ``KeyError`` like
    torch's ``mesh["x"]`` and a ``ValueError`` like the other bad-argument errors."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


def _names_tuple(names: Sequence[str] | str | None, ndim: int, what: str
                 ) -> tuple[str, ...] | None:
    """``mesh_dim_names`` as a tuple of ``ndim`` unique strings (a lone string is one name)."""
    if names is None:
        return None
    if isinstance(names, str):
        if ndim != 1:
            raise ValueError(
                f"{what}: mesh_dim_names={names!r} is one string but the mesh is {ndim}-D; pass "
                f"a tuple of {ndim} names, one per dimension (e.g. mesh_dim_names=('dp', 'tp'))"
            )
        names = (names,)
    names = tuple(names)
    bad = [n for n in names if not isinstance(n, str)]
    if bad:
        raise TypeError(f"{what}: mesh_dim_names {names} must be strings, got {bad}")
    if len(names) != ndim:
        raise ValueError(
            f"{what}: {len(names)} mesh_dim_names {names} for a {ndim}-D mesh; give one name "
            f"per dimension"
        )
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"{what}: mesh_dim_names {names} repeats {dup}; names must be unique")
    return names


def _check_device_type(device_type: str | None, platform: Platform, what: str) -> None:
    """A named device type must be the selected backend's: a mesh labelled with one device
    type over another backend's tensors and groups would be wrong everywhere it is used."""
    if device_type is None or device_type == platform.device_type:
        return
    if not isinstance(device_type, str):
        raise TypeError(f"{what}: device_type must be a string, got {device_type!r}")
    if ":" in device_type:
        raise ValueError(
            f"{what}: device_type {device_type!r} names a device index; pass the type only "
            f"({device_type.split(':')[0]!r}), as torch requires"
        )
    matching = sorted(n for n, info in backends().items()
                      if getattr(info.cls, "device_type", None) == device_type)
    hint = (f"backends for {device_type!r}: {', '.join(matching)}" if matching
            else f"no installed backend has device type {device_type!r}")
    raise ValueError(
        f"{what}: device_type {device_type!r} does not match the selected hyperpar backend "
        f"{platform.name!r} (device type {platform.device_type!r}). Choose the backend with "
        f"HYPERPAR_BACKEND=<name> or hyperpar.set_backend(<name>) ({hint}; `hyperpar info` "
        f"lists them), or pass device_type={platform.device_type!r} or leave it out"
    )


def ensure_world(platform: Platform) -> None:
    """Join the default process group from the launcher's environment (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) when none exists, as torch's mesh does;
    a lone ``python script.py`` becomes a world of one. The one rule by which every hyperpar
    entry point (meshes, ``PipelineModule``) joins the world without an explicit
    ``init_process_group``."""
    if not platform.is_initialized():
        platform.init_process_group()


def _grid(mesh: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(shape, ranks in row-major order)`` of a mesh given as a nested list or tuple of ints,
    a lone int (a 1-element mesh), or anything with ``tolist()`` (a torch tensor, a numpy array,
    a MindSpore tensor)."""
    if hasattr(mesh, "tolist"):
        mesh = mesh.tolist()
    if _is_rank(mesh):
        return (1,), (operator.index(mesh),)
    shape: list[int] = []
    level: list[Any] = [mesh]
    while level and not _is_rank(level[0]):
        if not all(isinstance(x, Sequence) and not isinstance(x, str) for x in level):
            raise TypeError(f"DeviceMesh: mesh must be a nested list of int ranks (or a tensor / "
                            f"array of them), got {mesh!r}")
        lengths = {len(x) for x in level}
        if len(lengths) != 1:
            raise ValueError(f"DeviceMesh: mesh {mesh!r} is ragged (rows of lengths "
                             f"{sorted(lengths)}); every row of a dimension must be as long")
        shape.append(lengths.pop())
        level = [y for x in level for y in x]
    if not all(_is_rank(r) for r in level):
        raise TypeError(f"DeviceMesh: mesh must hold int ranks, got {mesh!r}")
    if not level:
        raise ValueError(f"DeviceMesh: mesh {mesh!r} holds no rank; give at least one")
    return tuple(shape), tuple(operator.index(r) for r in level)


def _is_rank(x: Any) -> bool:
    return hasattr(x, "__index__") and not isinstance(x, bool)


def _strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides of ``shape`` (in elements)."""
    out, step = [], 1
    for size in reversed(shape):
        out.append(step)
        step *= size
    return tuple(reversed(out))


def _nested(ranks: Sequence[int], shape: Sequence[int]) -> list[Any]:
    """``ranks`` (row-major) as a nested list of ``shape``."""
    if len(shape) == 1:
        return list(ranks)
    step = math.prod(shape[1:])
    return [_nested(ranks[i * step:(i + 1) * step], shape[1:]) for i in range(shape[0])]


def _walk(shape: Sequence[int], ranks: Sequence[int], fixed: dict[int, int],
          dims: Sequence[int]) -> list[int]:
    """The ranks met walking ``dims`` (row-major, in the order given) with the other dims at
    their ``fixed`` index."""
    strides = _strides(shape)
    base = sum(strides[d] * i for d, i in fixed.items())
    return [ranks[base + sum(strides[d] * i for d, i in zip(dims, index, strict=True))]
            for index in itertools.product(*(range(shape[d]) for d in dims))]


def _slices(shape: Sequence[int], ranks: Sequence[int], dims: Sequence[int]
            ) -> list[tuple[int, ...]]:
    """Every rank list obtained by walking ``dims`` (row-major) with the other dims fixed, in a
    deterministic order that is the same on every rank (the other dims' indices, row-major)."""
    others = [d for d in range(len(shape)) if d not in dims]
    return [tuple(_walk(shape, ranks, dict(zip(others, index, strict=True)), dims))
            for index in itertools.product(*(range(shape[d]) for d in others))]


def _unravel(index: int, shape: Sequence[int]) -> list[int]:
    """The coordinate of row-major position ``index`` in ``shape``."""
    return [index // stride % size for stride, size in zip(_strides(shape), shape, strict=True)]


class DeviceMesh:
    """An n-D grid of global ranks with named dimensions.

    Build one with :func:`init_device_mesh`. ``mesh["tp"]`` or ``mesh["dp", "tp"]`` slice it to
    the sub-mesh containing this rank; :meth:`flatten` merges several dims into one. Each mesh
    dimension has a process group (``get_group(dim)``), created once per rank list and shared
    by every mesh that uses that rank list.
    """

    def __init__(self, device_type: str | None, mesh: Any, *,
                 mesh_dim_names: Sequence[str] | str | None = None,
                 _groups: list[Group] | None = None, _root: DeviceMesh | None = None,
                 _root_dims: tuple[int, ...] | None = None) -> None:
        platform = get_platform()
        if _groups is None:  # a root mesh: check what the user named, join the world
            _check_device_type(device_type, platform, "DeviceMesh")
            ensure_world(platform)
        self.device_type = device_type or platform.device_type
        shape, flat = _grid(mesh)
        self._shape, self._ranks = shape, flat
        self._mesh_tensor: Any = None  # mesh.mesh, built on first use
        names = _names_tuple(mesh_dim_names, len(shape), "DeviceMesh")
        self.mesh_dim_names = names
        if len(set(flat)) != len(flat):
            raise ValueError(f"mesh {self.tolist()} lists a rank twice")
        self._root = _root if _root is not None else self
        self._root_dims = _root_dims if _root_dims is not None else tuple(range(len(shape)))
        self._flattened: dict[str, DeviceMesh] = {}
        self._submeshes: dict[tuple[int, ...], DeviceMesh] = {}
        rank = platform.rank()
        self._rank = rank
        self._coordinate = (None if rank not in flat else
                            _unravel(flat.index(rank), shape))
        self._key = (self.device_type, flat, shape, names)
        self._hash = hash(self._key)
        if _groups is not None:
            self._groups = list(_groups)
        else:
            # Collective: every rank creates every group of every dim, in the same order (a
            # platform whose library lets only members create a group skips the others).
            self._groups = []
            for dim in range(len(shape)):
                mine = None
                for ranks in _slices(shape, flat, [dim]):
                    group = platform.new_group(list(ranks))
                    if rank in ranks:
                        mine = group
                self._groups.append(mine)
        self._group_ranks = [self._dim_ranks(d) for d in range(len(shape))]

    @property
    def mesh(self) -> Any:
        """The rank grid as a framework tensor (torch: an int64 CPU tensor, as torch's own
        ``DeviceMesh.mesh``), made by the platform's ``rank_tensor`` on first use. Code that
        only needs the ranks reads :meth:`tolist` and :attr:`shape`, which need no framework."""
        if self._mesh_tensor is None:
            self._mesh_tensor = get_platform().rank_tensor(self.tolist())
        return self._mesh_tensor

    def tolist(self) -> list[Any]:
        """The rank grid as a nested list of ints (``mesh.mesh.tolist()`` without a tensor)."""
        return _nested(self._ranks, self._shape)

    # -------------------------------------------------------------- identity
    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, DeviceMesh) and self._key == other._key)

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        names = f", mesh_dim_names={self.mesh_dim_names}" if self.mesh_dim_names else ""
        return f"DeviceMesh({self.device_type!r}, {self.tolist()}{names})"

    # -------------------------------------------------------------- shape
    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    def size(self, mesh_dim: MeshDim | None = None) -> int:
        """Number of ranks in the mesh, or along ``mesh_dim`` (index or name)."""
        if mesh_dim is None:
            return math.prod(self._shape)
        return self._shape[self._dim(mesh_dim)]

    def _dim(self, mesh_dim: MeshDim) -> int:
        """Index of ``mesh_dim`` (a name of this mesh, or an index; negative allowed)."""
        if isinstance(mesh_dim, str):
            if not self.mesh_dim_names or mesh_dim not in self.mesh_dim_names:
                raise MeshDimError(self._no_such_dim(mesh_dim))
            return self.mesh_dim_names.index(mesh_dim)
        if isinstance(mesh_dim, bool) or not hasattr(mesh_dim, "__index__"):
            raise TypeError(f"a mesh dimension is a name or an index, got {mesh_dim!r}")
        index = operator.index(mesh_dim)
        if not -self.ndim <= index < self.ndim:
            raise IndexError(f"mesh dimension {index} out of range for a {self.ndim}-D mesh "
                             f"{self!r}")
        return index % self.ndim

    def _no_such_dim(self, name: str, default: bool = False) -> str:
        flat = sorted(self._root._flattened)
        names = (f"{self.mesh_dim_names}" if self.mesh_dim_names
                 else f"unnamed (index them 0..{self.ndim - 1})")
        fix = ("pass the dimension to use (a name or an index) or its 1-D sub-mesh" if default
               else "pass one of these names or an index")
        return (f"mesh {self!r} has no dimension named {name!r}"
                + (" (the default)" if default else "") + f"; its dimensions are {names}"
                + (f", flattened: {flat}" if flat else "") + f"; {fix}")

    # -------------------------------------------------------------- ranks and groups
    def get_rank(self) -> int:
        """This process's global rank."""
        return self._rank

    def get_coordinate(self) -> list[int] | None:
        """This rank's coordinate in the mesh, or ``None`` if it is not part of it."""
        return None if self._coordinate is None else list(self._coordinate)

    def get_local_rank(self, mesh_dim: MeshDim | None = None) -> int:
        """This rank's index along ``mesh_dim`` (may be omitted on a 1-D mesh)."""
        if mesh_dim is None:
            if self.ndim != 1:
                raise ValueError(f"get_local_rank() needs mesh_dim on a {self.ndim}-D mesh")
            mesh_dim = 0
        if self._coordinate is None:
            raise RuntimeError(f"rank {self._rank} is not part of {self!r}")
        return self._coordinate[self._dim(mesh_dim)]

    def get_group(self, mesh_dim: MeshDim | None = None) -> Group:
        """The process group of ``mesh_dim`` containing this rank (may be omitted on 1-D)."""
        if mesh_dim is None:
            if self.ndim != 1:
                raise ValueError(
                    f"get_group() needs mesh_dim on a {self.ndim}-D mesh (or use get_all_groups())"
                )
            mesh_dim = 0
        return self._groups[self._dim(mesh_dim)]

    def get_all_groups(self) -> list[Group]:
        """The process group of every mesh dimension that contains this rank, in order."""
        return list(self._groups)

    def _dim_ranks(self, dim: int) -> tuple[int, ...]:
        if self._coordinate is None:
            return ()
        fixed = {d: c for d, c in enumerate(self._coordinate) if d != dim}
        return tuple(_walk(self._shape, self._ranks, fixed, [dim]))

    def group_ranks(self, mesh_dim: MeshDim) -> tuple[int, ...]:
        """Global ranks of the group of ``mesh_dim`` that contains this rank."""
        return self._group_ranks[self._dim(mesh_dim)]

    # -------------------------------------------------------------- slicing
    def __getitem__(self, names: str | int | Sequence[str]) -> DeviceMesh:
        """The sub-mesh of the named dimensions (in the order given) containing this rank.
        An int ``mesh[i]`` is the 1-D sub-mesh of dimension ``i`` (as :meth:`get_mesh`), for
        code that walks a mesh's dimensions by index."""
        if isinstance(names, int) and not isinstance(names, bool):
            return self._submesh((self._dim(names),))
        if isinstance(names, str):
            names = (names,)
        if not isinstance(names, Sequence) or not all(isinstance(n, str) for n in names):
            raise TypeError(
                f"a DeviceMesh is sliced by dimension name (mesh['tp'] or mesh['dp', 'tp']), as "
                f"torch's is; got {names!r}. For a dimension by index use mesh[i] or "
                f"mesh.get_mesh(i)"
            )
        names = tuple(names)
        if not self.mesh_dim_names:
            raise MeshDimError(
                f"cannot slice {self!r} by name: it has no mesh_dim_names. Pass mesh_dim_names= "
                f"to init_device_mesh, or use mesh.get_mesh(i) for dimension i"
            )
        if len(set(names)) != len(names):
            raise MeshDimError(f"mesh slice {names} repeats a dimension name")
        if names == self.mesh_dim_names:
            return self
        if len(names) == 1 and names[0] in self._root._flattened:
            return self._root._flattened[names[0]]
        for name in names:
            if name not in self.mesh_dim_names:
                raise MeshDimError(self._no_such_dim(name))
        return self._submesh(tuple(self.mesh_dim_names.index(n) for n in names))

    def _submesh(self, dims: tuple[int, ...]) -> DeviceMesh:
        """The sub-mesh of ``dims`` (in that order) containing this rank; cached per mesh."""
        if dims == tuple(range(self.ndim)):
            return self
        cached = self._submeshes.get(dims)
        if cached is not None:
            return cached
        if self._coordinate is None:
            raise RuntimeError(f"rank {self._rank} is not part of {self!r}; cannot slice it")
        fixed = {d: c for d, c in enumerate(self._coordinate) if d not in dims}
        sub = _nested(_walk(self._shape, self._ranks, fixed, dims), [self._shape[d] for d in dims])
        names = (tuple(self.mesh_dim_names[d] for d in dims) if self.mesh_dim_names else None)
        mesh = DeviceMesh(self.device_type, sub, mesh_dim_names=names,
                          _groups=[self._groups[d] for d in dims], _root=self._root,
                          _root_dims=tuple(self._root_dims[d] for d in dims))
        self._submeshes[dims] = mesh
        return mesh

    # -------------------------------------------------------------- the dimension resolver
    def get_mesh(self, mesh_dim: MeshDim | None = None, *, default: str | None = None
                 ) -> DeviceMesh:
        """The 1-D mesh along ``mesh_dim`` containing this rank. The one place where a mesh
        dimension asked for by a user (or by a library default such as ``"tp"``) is resolved.

        * ``mesh_dim``: a dimension name (also one made by :meth:`flatten`) or an index
          (negative allowed);
        * ``mesh_dim=None``: a 1-D mesh is itself; an n-D mesh takes the dimension named
          ``default``; with no ``default`` that is an error;
        * an unnamed 1-D mesh answers to any name: it has no name to disagree with.

        Raises :class:`MeshDimError` naming the dimension asked for and listing the mesh's.
        """
        found = self.get_mesh_or_none(mesh_dim, default=default)
        if found is None:
            raise MeshDimError(self._no_such_dim(
                default if mesh_dim is None else mesh_dim, default=mesh_dim is None))
        return found

    def get_mesh_or_none(self, mesh_dim: MeshDim | None = None, *, default: str | None = None
                         ) -> DeviceMesh | None:
        """Like :meth:`get_mesh`, but ``None`` when the mesh has no dimension of that name (a
        dimension that is optional to the caller). A bad index is still an error."""
        if mesh_dim is None:
            if self.ndim == 1:
                return self
            if default is None:
                raise MeshDimError(
                    f"{self!r} is {self.ndim}-D: say which dimension to use (one of "
                    f"{self.mesh_dim_names or 'its indices'}), or pass its 1-D sub-mesh"
                )
            mesh_dim = default
        if isinstance(mesh_dim, str):
            names = self.mesh_dim_names
            if names is None and self.ndim == 1:
                return self
            if names is not None and mesh_dim in names:
                return self._submesh((names.index(mesh_dim),))
            return self._root._flattened.get(mesh_dim)
        return self._submesh((self._dim(mesh_dim),))

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
        for ranks in _slices(root._shape, root._ranks, list(self._root_dims)):
            group = platform.new_group(list(ranks))
            if self._rank in ranks:
                mine = group
        flat = DeviceMesh(self.device_type, list(self._ranks),
                          mesh_dim_names=(mesh_dim_name,), _groups=[mine], _root=root,
                          _root_dims=None)
        root._flattened[mesh_dim_name] = flat
        return flat

    _flatten = flatten  # torch's spelling

    def _unflatten(self, dim: MeshDim, mesh_sizes: Sequence[int],
                   mesh_dim_names: Sequence[str], backend_override: Any = None) -> DeviceMesh:
        """A mesh over the same ranks with dimension ``dim`` split into ``mesh_sizes`` (row-
        major), named ``mesh_dim_names`` (torch's ``DeviceMesh._unflatten``, which torchtitan's
        ``ParallelDims`` builds all its meshes with).

        Collective over the world: every rank must call it. Several unflattenings of one mesh
        describe the same devices: their sub-meshes of equal ranks and names compare equal and
        share process groups, so DTensors on them combine. Only a mesh over the whole world can
        be unflattened (unflatten the world mesh, then slice)."""
        what = "DeviceMesh._unflatten"
        if isinstance(dim, str) and (not self.mesh_dim_names or dim not in self.mesh_dim_names):
            raise ValueError(f"{what}: dim {dim!r} is not in {self.mesh_dim_names}; pass one "
                             f"of these names or an index")
        d = self._dim(dim)
        if isinstance(mesh_sizes, int) or not all(
                hasattr(s, "__index__") and not isinstance(s, bool) for s in mesh_sizes):
            raise TypeError(f"{what}: mesh_sizes must be a tuple of ints, got {mesh_sizes!r}")
        sizes = tuple(operator.index(s) for s in mesh_sizes)
        names = (mesh_dim_names,) if isinstance(mesh_dim_names, str) else tuple(mesh_dim_names)
        if len(sizes) != len(names):
            raise ValueError(f"{what}: {len(sizes)} mesh_sizes {sizes} but {len(names)} "
                             f"mesh_dim_names {names}; give one name per size")
        if any(s < 1 for s in sizes) or math.prod(sizes) != self._shape[d]:
            raise ValueError(
                f"{what}: mesh_sizes {sizes} (product {math.prod(sizes)}) must be positive and "
                f"multiply to the size {self._shape[d]} of dimension {dim!r} of {self!r}")
        _check_backend_override(backend_override, dict(zip(names, sizes, strict=True)), what)
        world = get_platform().world_size()
        if sorted(self._ranks) != list(range(world)):
            raise NotImplementedError(
                f"{what}: {self!r} does not cover the world of {world} ranks; hyperpar "
                f"unflattens only a mesh over the whole world: unflatten the world mesh and "
                f"slice the result (as torchtitan's ParallelDims does)")
        old = self.mesh_dim_names or tuple(f"_dim{i}" for i in range(self.ndim))
        new_names = old[:d] + names + old[d + 1:]
        _names_tuple(new_names, len(new_names), what)  # unique strings, else a clear error
        shape = self._shape[:d] + sizes + self._shape[d + 1:]
        return DeviceMesh(self.device_type, _nested(self._ranks, shape),
                          mesh_dim_names=new_names)

    # -------------------------------------------------------------- current mesh
    def __enter__(self) -> DeviceMesh:
        _MESH_STACK.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _MESH_STACK.pop()


def _check_backend_override(override: Any, sizes: dict[str, int], what: str) -> None:
    """Accept torch's ``backend_override`` where it cannot change a result: any entry for a
    size-1 dim (it never communicates) and ``"fake"`` for any dim -- torchtitan's ParallelDims
    marks every dim it will not communicate over so (torch then makes no real group; hyperpar
    makes its groups as usual, so a stray collective there is still right). Any other backend
    for a real dim raises: hyperpar picks the backend per platform."""
    if override is None:
        return
    if not isinstance(override, Mapping):
        raise NotImplementedError(f"{what}: backend_override must be a mapping of dim name to "
                                  f"backend, got {override!r}")
    real = {k: v for k, v in override.items() if sizes.get(k, 0) != 1 and v != "fake"}
    if real:
        raise NotImplementedError(
            f"{what}: backend_override {real} picks a backend for dims of size > 1 (sizes "
            f"{sizes}); hyperpar chooses the backend per platform: leave these out")


def current_mesh() -> DeviceMesh | None:
    """The innermost mesh entered with ``with mesh:``, or ``None``."""
    return _MESH_STACK[-1] if _MESH_STACK else None


def _require_mesh(mesh: DeviceMesh | None, what: str) -> DeviceMesh:
    mesh = mesh if mesh is not None else current_mesh()
    if mesh is None:
        raise ValueError(f"{what}: no device_mesh given and no mesh is current (pass "
                         f"device_mesh=init_device_mesh(...) or use `with mesh:`)")
    return mesh


@overload
def init_device_mesh(mesh_shape: Sequence[int] | int,
                     mesh_dim_names: Sequence[str] | str | None = None, *,
                     device_type: str | None = None) -> DeviceMesh: ...


@overload
def init_device_mesh(device_type: str, mesh_shape: Sequence[int] | int, *,
                     mesh_dim_names: Sequence[str] | str | None = None) -> DeviceMesh: ...


def init_device_mesh(*args: Any, device_type: str | None = None,
                     mesh_shape: Sequence[int] | int | None = None,
                     mesh_dim_names: Sequence[str] | str | None = None) -> DeviceMesh:
    """Create a mesh of shape ``mesh_shape`` over every rank of the world (row-major).

    Two call forms, told apart by the first argument (a device type is a string, a shape
    never is):

    * hyperpar's ``init_device_mesh(mesh_shape, mesh_dim_names=None, *, device_type=None)``:
      the device type is the selected backend's;
    * torch's ``init_device_mesh(device_type, mesh_shape, *, mesh_dim_names=None)``: the
      device type must be the selected backend's (else a ``ValueError`` says how to choose
      another backend).

    Every argument may also be passed by keyword. A single string as ``mesh_dim_names`` names
    a 1-D mesh. When no process group exists yet, the default one is joined from the
    launcher's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, as set
    by ``hyperpar run`` or ``torchrun``), as torch does. The product of ``mesh_shape`` must be
    the world size.
    """
    device_type, mesh_shape, mesh_dim_names = _parse_mesh_args(
        args, device_type, mesh_shape, mesh_dim_names)
    platform = get_platform()
    _check_device_type(device_type, platform, "init_device_mesh")
    names = _names_tuple(mesh_dim_names, len(mesh_shape), "init_device_mesh")
    ensure_world(platform)
    world = platform.world_size()
    if math.prod(mesh_shape) != world:
        raise ValueError(
            f"init_device_mesh: mesh shape {mesh_shape} holds {math.prod(mesh_shape)} ranks but "
            f"the world has {world}; the product of mesh_shape must equal the world size (the "
            f"number of processes launched, e.g. `hyperpar run -n {math.prod(mesh_shape)}`)"
        )
    return DeviceMesh(device_type, _nested(range(world), mesh_shape), mesh_dim_names=names)


def _parse_mesh_args(args: tuple[Any, ...], device_type: str | None, mesh_shape: Any,
                     mesh_dim_names: Any) -> tuple[str | None, tuple[int, ...], Any]:
    """``(device_type, mesh_shape, mesh_dim_names)`` from either call form, each given once."""
    slots = (("device_type", "mesh_shape", "mesh_dim_names") if args and isinstance(args[0], str)
             else ("mesh_shape", "mesh_dim_names"))
    if len(args) > len(slots):
        raise TypeError(
            f"init_device_mesh takes at most {len(slots)} positional arguments "
            f"({', '.join(slots)}) in this form, got {len(args)}: {args!r}"
        )
    given = {"device_type": device_type, "mesh_shape": mesh_shape,
             "mesh_dim_names": mesh_dim_names}
    for slot, value in zip(slots, args, strict=False):
        if given[slot] is not None:
            raise TypeError(f"init_device_mesh got {slot} twice: {value!r} by position and "
                            f"{given[slot]!r} by keyword")
        given[slot] = value
    shape = given["mesh_shape"]
    if shape is None:
        raise TypeError("init_device_mesh: mesh_shape is required, e.g. init_device_mesh((2, 2), "
                        "mesh_dim_names=('dp', 'tp'))")
    if isinstance(shape, int) and not isinstance(shape, bool):
        shape = (shape,)
    if (isinstance(shape, str) or not isinstance(shape, Sequence)
            or not all(hasattr(s, "__index__") and not isinstance(s, bool) for s in shape)):
        raise TypeError(f"init_device_mesh: mesh_shape must be a tuple of ints, got {shape!r}")
    shape = tuple(operator.index(s) for s in shape)
    if not shape or any(s < 1 for s in shape):
        raise ValueError(f"init_device_mesh: mesh_shape must be positive sizes, got {shape}")
    return given["device_type"], shape, given["mesh_dim_names"]
