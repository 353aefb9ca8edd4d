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

from hyperpar.dtensor.api import DTensor, DTensorSpec
from hyperpar.dtensor.mesh import DeviceMesh
from hyperpar.dtensor.placement import Placement, Replicate, Shard, chunk_bounds


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
                 device: torch.device) -> None:
        self.module, self.name = module, name
        self.fqn = name
        local = param.to_local() if isinstance(param, DTensor) else param.data
        if local.ndim == 0:
            raise ValueError(
                f"fully_shard: parameter {name!r} is a 0-dim tensor; fully_shard splits dim 0, "
                "so give it shape (1,) or keep it out of the sharded module")
        self.requires_grad = param.requires_grad
        self.orig_dtype = local.dtype
        self.param_dtype = param_dtype
        self.unsharded_dtype = param_dtype or local.dtype
        self.device = device
        self.offload = offload
        self.local_shape = tuple(local.shape)  # the unsharded (TP-local) shape
        rows = self.local_shape[0]
        self.row_numel = math.prod(self.local_shape[1:])
        self.chunk_rows = -(-rows // shard_size)
        self.padded_numel = self.chunk_rows * self.row_numel
        start, length = chunk_bounds(rows, shard_size, shard_rank)
        self.shard_rows = length
        shard = local[start:start + length]
        home = host_device() if offload else (device if local.device.type != "meta"
                                              else local.device)
        if shard.device.type == "meta":
            shard_local = torch.empty(shard.shape, dtype=local.dtype, device="meta")
        else:
            shard_local = shard.detach().to(home).clone()
        spec, self.mesh = _sharded_spec(param, dp_mesh)
        dt = DTensor(shard_local, spec, requires_grad=False)
        self.sharded = nn.Parameter(dt, requires_grad=param.requires_grad)
        # The tensor forward/backward use: a view of a padded buffer so that the all-gather
        # output can be copied in with one strided copy. Allocated on unshard, freed on reshard.
        self._padded = torch.empty(0, dtype=self.unsharded_dtype, device=device)
        self.unsharded: nn.Parameter | None = None
        self.offset = 0  # of this param's piece inside one rank's flat shard (elements)

    # ------------------------------------------------------------------ sharded side
    def shard_local(self) -> torch.Tensor:
        return self.sharded.to_local()

    def apply_to_local(self, fn: Any) -> None:
        """``module._apply(fn)`` for this shard: a new DTensor parameter around
        ``fn(local)`` with the same layout (the unsharded buffer is rebuilt to match)."""
        local = self.sharded.to_local()
        new = fn(local)
        if new is local:
            return
        dt = DTensor(new.detach(), self.sharded._spec, requires_grad=False)
        param = nn.Parameter(dt, requires_grad=self.requires_grad)
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
        """Make the module attribute the sharded DTensor parameter again."""
        self.module._parameters[self.name] = self.sharded

    # ------------------------------------------------------------------ unsharded side
    def alloc_unsharded(self, shard_size: int) -> torch.Tensor:
        """Allocate (or re-allocate) the padded unsharded buffer; returns it as [n, c*row]."""
        numel = shard_size * self.padded_numel
        if self.unsharded is None:
            self._padded = torch.empty(numel, dtype=self.unsharded_dtype, device=self.device)
            view = self._padded[:math.prod(self.local_shape)].view(self.local_shape)
            self.unsharded = nn.Parameter(view, requires_grad=self.requires_grad)
        else:
            _alloc(self._padded, numel * self._padded.element_size())
        return self._padded.view(shard_size, self.padded_numel)

    def bind_unsharded(self) -> None:
        self.module._parameters[self.name] = self.unsharded

    def free_unsharded(self) -> None:
        if self.unsharded is not None:
            _free(self._padded)

    def accumulate_shard_grad(self, flat: torch.Tensor) -> None:
        """Add (or set) this rank's reduced gradient piece to the sharded parameter."""
        piece = flat[self.offset:self.offset + self.shard_rows * self.row_numel]
        local = self.shard_local()
        piece = piece.view(local.shape).to(dtype=local.dtype, device=local.device)
        if local.grad is None:
            local.grad = piece.clone()
        else:
            local.grad.add_(piece)


def _sharded_spec(param: nn.Parameter, dp_mesh: DeviceMesh) -> tuple[DTensorSpec, DeviceMesh]:
    """Mesh and placements of the sharded parameter: the parameter's own (TP) mesh dims first,
    then the data-parallel dims -- so ``Shard(0)`` over dp splits the TP-local rows, the order
    in which fully_shard really splits them, and ``full_tensor()`` reassembles correctly."""
    dp_places: tuple[Placement, ...] = (
        (Shard(0),) if dp_mesh.ndim == 1 else (Replicate(), Shard(0)))
    if not isinstance(param, DTensor):
        return DTensorSpec(dp_mesh, dp_places, param.shape), dp_mesh
    tp_mesh = param.device_mesh
    tp_names, dp_names = tp_mesh.mesh_dim_names, dp_mesh.mesh_dim_names
    if tp_mesh._root is not dp_mesh._root or not tp_names or not dp_names:
        raise ValueError(
            f"fully_shard: parameter is a DTensor on {tp_mesh!r}, which is not a slice of the "
            f"same named mesh as the data-parallel mesh {dp_mesh!r}; build one mesh, e.g. "
            "init_device_mesh((dp, tp), mesh_dim_names=('dp', 'tp')), and pass mesh['tp'] to "
            "parallelize_module and mesh['dp'] to fully_shard")
    if set(tp_names) & set(dp_names):
        raise ValueError(
            f"fully_shard: parameter is already laid out over mesh dims {tp_names}, which "
            f"overlap the data-parallel dims {dp_names}")
    mesh = tp_mesh._root[tuple(tp_names) + tuple(dp_names)]
    return DTensorSpec(mesh, tuple(param.placements) + dp_places, param.shape), mesh
