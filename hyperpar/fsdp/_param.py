"""One parameter under fully_shard: its dim-0 shard (a DTensor), its unsharded tensor, and the
layout of both inside its group's flat all-gather / reduce-scatter buffers.

Sharding follows ``torch.chunk`` on dim 0 of the parameter's *local* tensor (the tensor-parallel
shard for a TP parameter): rank ``r`` of ``n`` holds rows ``[r*c, (r+1)*c)`` with
``c = ceil(rows / n)``, so the last ranks may hold fewer rows or none. In the flat buffers every
rank's piece is padded to ``c`` rows, which makes all-gather inputs equal in size.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from hyperpar.dtensor.mesh import DeviceMesh, _nested, _slices
from hyperpar.dtensor.placement import Placement, Replicate, Shard, chunk_bounds
from hyperpar.torch.dtensor.api import DTensor, DTensorSpec


def host_device() -> torch.device:
    """The host (where CPUOffloadPolicy keeps shards), found without naming it."""
    return torch.empty(0).cpu().device


def _free(tensor: torch.Tensor) -> None:
    """Release a tensor's memory but keep the tensor object (autograd holds it)."""
    storage = tensor.untyped_storage()
    if storage.size() != 0:
        storage.resize_(0)


def _alloc(tensor: torch.Tensor, nbytes: int) -> None:
    storage = tensor.untyped_storage()
    if storage.size() != nbytes:
        storage.resize_(nbytes)


class ShardedParam:
    """The sharded view and the unsharded view of one parameter of a fully_shard group."""

    def __init__(self, module: nn.Module, name: str, param: nn.Parameter, *,
                 dp_mesh: DeviceMesh, shard_rank: int, shard_size: int,
                 param_dtype: torch.dtype | None, offload: bool,
                 device: torch.device, shard_dim: int = 0) -> None:
        self.module, self.name = module, name
        self.fqn = name
        #: every (module, attribute) that holds this parameter (more than one when tied)
        self.aliases: list[tuple[nn.Module, str]] = [(module, name)]
        local = param.to_local() if isinstance(param, DTensor) else param.data
        if local.ndim == 0:
            raise ValueError(
                f"fully_shard: parameter {name!r} is a 0-dim tensor; fully_shard splits dim 0, "
                "so give it shape (1,) or keep it out of the sharded module")
        if not -local.ndim <= shard_dim < local.ndim:
            raise ValueError(
                f"fully_shard: shard_placement_fn gave Shard({shard_dim}) for parameter "
                f"{name!r} of shape {tuple(local.shape)}; the dim must be in "
                f"[{-local.ndim}, {local.ndim})")
        self.shard_dim = shard_dim % local.ndim
        if self.shard_dim and isinstance(param, DTensor):
            raise NotImplementedError(
                f"fully_shard: Shard({shard_dim}) for the tensor-parallel parameter {name!r}; "
                "fully_shard splits a tensor-parallel parameter on dim 0 only -- return None "
                "or Shard(0) from shard_placement_fn for it")
        # the flat buffers hold every piece with the shard dim moved to the front
        if self.shard_dim:
            local = local.movedim(self.shard_dim, 0)
        self.orig_dtype = local.dtype
        self.param_dtype = param_dtype
        self.unsharded_dtype = param_dtype or local.dtype
        self.device = device
        self.offload = offload
        self.local_shape = tuple(local.shape)  # the unsharded (TP-local) shape, dim moved
        rows = self.local_shape[0]
        self.row_numel = math.prod(self.local_shape[1:])
        self.chunk_rows = -(-rows // shard_size)
        self.padded_numel = self.chunk_rows * self.row_numel
        start, length = chunk_bounds(rows, shard_size, shard_rank)
        self.shard_rows = length
        shard = local[start:start + length]
        home = host_device() if offload else (device if local.device.type != "meta"
                                              else local.device)
        if self.shard_dim:
            shard = shard.movedim(0, self.shard_dim)
        if shard.device.type == "meta":
            shard_local = torch.empty(shard.shape, dtype=local.dtype, device="meta")
        else:
            shard_local = shard.detach().to(home).clone()
        spec, self.mesh = _sharded_spec(param, dp_mesh, self.shard_dim)
        # a TP parameter is handed to the module as a DTensor with its TP layout (as torch's
        # FSDP2 does), so per-op DTensor code in forward meets no plain tensor
        self.tp_spec: DTensorSpec | None = param._spec if isinstance(param, DTensor) else None
        self._bound: nn.Parameter | None = None
        dt = DTensor(shard_local, spec, requires_grad=False)
        self.sharded = nn.Parameter(dt, requires_grad=param.requires_grad)
        # The tensor forward/backward use: a view of a padded buffer so that the all-gather
        # output can be copied in with one strided copy. Allocated on unshard, freed on reshard.
        self._padded = torch.empty(0, dtype=self.unsharded_dtype, device=device)
        self.unsharded: nn.Parameter | None = None
        self.offset = 0  # of this param's piece inside one rank's flat shard (elements)

    @property
    def requires_grad(self) -> bool:
        """Read from the sharded parameter each time: ``requires_grad_`` after fully_shard is
        honoured from the next unshard on."""
        return self.sharded.requires_grad

    # ------------------------------------------------------------------ sharded side
    def shard_local(self) -> torch.Tensor:
        """This rank's shard as stored in the flat buffers (shard dim first)."""
        local = self.sharded.to_local()
        return local.movedim(self.shard_dim, 0) if self.shard_dim else local

    def apply_to_local(self, fn: Any) -> None:
        """``module._apply(fn)`` for this shard: a new DTensor parameter around
        ``fn(local)`` with the same layout (the unsharded buffer is rebuilt to match)."""
        local = self.sharded.to_local()
        new = fn(local)
        if new is local:
            return
        dt = DTensor(new.detach(), self.sharded._spec, requires_grad=False)
        param = nn.Parameter(dt, requires_grad=self.sharded.requires_grad)
        param._hp_fsdp = True
        self.sharded = param
        self.orig_dtype = new.dtype
        if self.param_dtype is None:
            self.unsharded_dtype = new.dtype
        if not self.offload and new.device.type != "meta":
            self.device = new.device
        self.unsharded = None  # rebuilt on the next unshard, in the new dtype/device
        self._hooked = False

    def rebind_sharded(self) -> None:
        """Make the module attribute(s) the sharded DTensor parameter again."""
        for module, name in self.aliases:
            module._parameters[name] = self.sharded

    # ------------------------------------------------------------------ unsharded side
    def alloc_unsharded(self, shard_size: int) -> torch.Tensor:
        """Allocate (or re-allocate) the padded unsharded buffer; returns it as [n, c*row]."""
        numel = shard_size * self.padded_numel
        if self.unsharded is None:
            self._padded = torch.empty(numel, dtype=self.unsharded_dtype, device=self.device)
            view = self._padded[:math.prod(self.local_shape)].view(self.local_shape)
            if self.shard_dim:  # the module sees the original dim order: a copy of its own
                view = torch.empty(view.movedim(0, self.shard_dim).shape,
                                   dtype=self.unsharded_dtype, device=self.device)
            self.unsharded = nn.Parameter(view, requires_grad=self.requires_grad)
            self._bound = None
        else:
            _alloc(self._padded, numel * self._padded.element_size())
            if self.shard_dim:
                _alloc(self.unsharded, self.unsharded.numel() * self.unsharded.element_size())
        return self._padded.view(shard_size, self.padded_numel)

    def finish_unsharded(self) -> None:
        """After the gathered rows were copied into the padded buffer: a parameter sharded
        on another dim copies them, dims restored, into its own tensor."""
        if self.shard_dim:
            rows = self._padded[:math.prod(self.local_shape)].view(self.local_shape)
            with torch.autograd._unsafe_preserve_version_counter(self.unsharded):
                self.unsharded.data.copy_(rows.movedim(0, self.shard_dim))
            _free(self._padded)
        if self.unsharded.requires_grad != self.requires_grad:
            self.unsharded.requires_grad_(self.requires_grad)
        self._bound_requires_grad = self.unsharded.requires_grad

    def keep_requires_grad(self) -> None:
        """Before a reshard: ``requires_grad_`` called while the module held the unsharded
        parameter (between a forward and its backward) is carried to the shard."""
        bound = getattr(self, "_bound_requires_grad", None)
        if self.unsharded is not None and bound is not None and \
                self.unsharded.requires_grad != bound:
            self.sharded.requires_grad_(self.unsharded.requires_grad)

    def bind_unsharded(self) -> None:
        bound = self.unsharded if self.tp_spec is None else self._tp_view()
        for module, name in self.aliases:
            module._parameters[name] = bound

    def _tp_view(self) -> nn.Parameter:
        """The unsharded TP parameter as the module sees it: a DTensor parameter whose local
        tensor *is* the plain unsharded leaf, so autograd accumulates the local gradient on the
        leaf that the reduce-scatter hook watches (hyperpar's autograd runs on local tensors).
        Made once per unsharded leaf: the leaf object survives reshard/unshard."""
        if self._bound is None:
            param = nn.Parameter(DTensor(self.unsharded.detach(), self.tp_spec),
                                 requires_grad=False)
            param._local = self.unsharded  # the leaf itself, not a detached alias
            self._bound = param
        return self._bound

    def free_unsharded(self) -> None:
        if self.unsharded is not None:
            _free(self._padded)
            if self.shard_dim:
                _free(self.unsharded)

    def flat_grad(self) -> torch.Tensor | None:
        """The unsharded gradient in flat-buffer order (shard dim first), or None."""
        if not self.requires_grad or self.unsharded is None:
            return None
        grad = self.unsharded.grad
        if grad is not None and self.shard_dim:
            grad = grad.movedim(self.shard_dim, 0)
        return grad

    def accumulate_shard_grad(self, flat: torch.Tensor) -> None:
        """Add (or set) this rank's reduced gradient piece to the sharded parameter."""
        piece = flat[self.offset:self.offset + self.shard_rows * self.row_numel]
        local = self.sharded.to_local()
        moved = self.shard_local()
        piece = piece.view(moved.shape).to(dtype=local.dtype, device=local.device)
        if self.shard_dim:
            piece = piece.movedim(0, self.shard_dim)
        if local.grad is None:
            local.grad = piece.clone(memory_format=torch.contiguous_format)
        else:
            local.grad.add_(piece)


def _sharded_spec(param: nn.Parameter, dp_mesh: DeviceMesh,
                  shard_dim: int = 0) -> tuple[DTensorSpec, DeviceMesh]:
    """Mesh and placements of the sharded parameter.

    A plain parameter: ``Shard(shard_dim)`` over the dp mesh (HSDP: ``(Replicate(), Shard)``).
    A tensor-parallel DTensor: one mesh of the dp and the TP dims. When the TP placements split
    other dims than fully_shard does (a rowwise weight: TP ``Shard(1)``, dp ``Shard(0)``), the
    dims come in torch's order -- dp first: ``(Shard(0), Shard(1))`` on ``("dp", "tp")``. When
    both split dim 0 (a colwise weight), fully_shard splits the TP-local rows, so the TP dims
    must come first for the placements to reassemble correctly (torch writes that layout as
    ``_StridedShard`` on ``("dp", "tp")``; hyperpar has no strided placement).
    """
    dp_places: tuple[Placement, ...] = (
        (Shard(shard_dim),) if dp_mesh.ndim == 1 else (Replicate(), Shard(shard_dim)))
    if not isinstance(param, DTensor):
        return DTensorSpec(dp_mesh, dp_places, param.shape), dp_mesh
    tp_mesh = param.device_mesh
    tp_names, dp_names = tp_mesh.mesh_dim_names, dp_mesh.mesh_dim_names
    if not tp_names or not dp_names or (
            tp_mesh._root is not dp_mesh._root and _joined(dp_mesh, tp_mesh) is None):
        raise ValueError(
            f"fully_shard: parameter is a DTensor on {tp_mesh!r}, which is not a slice of the "
            f"same named mesh as the data-parallel mesh {dp_mesh!r} (nor of a view of the same "
            "devices whose dp and TP groups tile one grid); build one mesh, e.g. "
            "init_device_mesh((dp, tp), mesh_dim_names=('dp', 'tp')), and pass mesh['tp'] to "
            "parallelize_module and mesh['dp'] to fully_shard")
    if set(tp_names) & set(dp_names):
        raise ValueError(
            f"fully_shard: parameter is already laid out over mesh dims {tp_names}, which "
            f"overlap the data-parallel dims {dp_names}")
    tp_places = tuple(param.placements)
    nested = any(isinstance(p, Shard) and p.dim == shard_dim for p in tp_places)
    if nested:
        names, places = tuple(tp_names) + tuple(dp_names), tp_places + dp_places
    else:
        names, places = tuple(dp_names) + tuple(tp_names), dp_places + tp_places
    if tp_mesh._root is dp_mesh._root:
        mesh = tp_mesh._root[names]
    else:  # two views (e.g. unflattenings) of the same devices: one mesh of both
        mesh = _joined(tp_mesh, dp_mesh) if nested else _joined(dp_mesh, tp_mesh)
    return DTensorSpec(mesh, places, param.shape), mesh


_JOINED: dict[tuple[DeviceMesh, DeviceMesh], DeviceMesh | None] = {}


def _joined(outer: DeviceMesh, inner: DeviceMesh) -> DeviceMesh | None:
    """The mesh of ``outer``'s dims then ``inner``'s when the two come from different root
    meshes over the same devices (torch accepts a TP and a dp mesh from two unflattenings of
    the world); None when they do not tile one grid. Every rank computes the same grid from
    the two roots, and the new mesh reuses both meshes' process groups (no collective)."""
    key = (outer, inner)
    if key in _JOINED:
        return _JOINED[key]
    root = inner._root
    slice_of = {r: ranks for ranks in _slices(root._shape, root._ranks, list(inner._root_dims))
                for r in ranks}
    grid: list[int] = []
    ok = outer.device_type == inner.device_type
    mine = inner._ranks.index(inner._rank) if inner._rank in inner._ranks else -1
    for r in outer._ranks:
        ranks = slice_of.get(r)
        # each outer rank at this rank's inner position: outer's groups are the new mesh's
        if not ok or ranks is None or len(ranks) != inner.size() or \
                set(ranks) & set(outer._ranks) != {r} or ranks.index(r) != mine:
            ok = False
            break
        grid.extend(ranks)
    mesh = None
    if ok and len(set(grid)) == len(grid) and tuple(slice_of.get(outer._rank, ())) == \
            tuple(inner._ranks):
        shape = tuple(outer.shape) + tuple(inner.shape)
        mesh = DeviceMesh(outer.device_type, _nested(tuple(grid), shape),
                          mesh_dim_names=tuple(outer.mesh_dim_names) +
                          tuple(inner.mesh_dim_names),
                          _groups=[outer.get_group(d) for d in range(outer.ndim)] +
                          [inner.get_group(d) for d in range(inner.ndim)])
    _JOINED[key] = mesh
    return mesh

