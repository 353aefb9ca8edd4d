"""DTensor: a ``torch.Tensor`` subclass holding this rank's shard of one logical tensor.

Design (see docs/dtensor.md): a wrapper subclass that intercepts torch functions with
``__torch_function__`` and looks the function up in one rule table (``_ops/registry.py``).
Autograd runs on the *local* tensors: the gradient of a DTensor laid out as ``p`` is the local
shard of the logical gradient laid out as ``p`` with Partial replaced by Replicate.
Redistributions carry their adjoint as backward; a replicated input of an op whose output is
sharded gets its gradient summed over those mesh dims.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hyperpar.dtensor.api_core import (
    check_local_shape,
    distribute_target,
    from_local_layout,
    grad_target,
    redistribute_target,
    refuse_dtensor_in_from_local,
)
from hyperpar.dtensor.mesh import DeviceMesh, _require_mesh
from hyperpar.dtensor.placement import (
    REPLICATE,
    Partial,
    Placement,
    Replicate,
    Shard,
    grad_placements_of,
)
from hyperpar.platform import get_platform
from hyperpar.torch.dtensor._shape_check import note_inferred
from hyperpar.torch.dtensor.redistribute import (
    local_shape_and_offset,
    redistribute_autograd,
    redistribute_local,
)

_is_compiling = torch.compiler.is_compiling


def _encode(placements: Sequence[Placement]) -> tuple:
    """Placements as plain constants (Dynamo passes no dataclass instance to a constant
    function)."""
    return tuple(("S", p.dim) if type(p) is Shard else
                 ("P", p.reduce_op) if type(p) is Partial else ("R", None) for p in placements)


def _decode(codes: tuple) -> tuple[Placement, ...]:
    return tuple(Shard(a) if k == "S" else Partial(a) if k == "P" else REPLICATE
                 for k, a in codes)


@torch._dynamo.assume_constant_result
def _interned_spec(mesh: DeviceMesh, codes: tuple, shape: tuple) -> DTensorSpec:
    """The interned spec, looked up outside the trace (Dynamo would otherwise guard on the
    size of the intern table and recompile whenever eager code adds a spec)."""
    return DTensorSpec._intern(mesh, _decode(codes), torch.Size(shape))


class DTensorSpec:
    """Mesh, placements and global shape of a DTensor (a small immutable value).

    Specs are interned: equal specs are the same object, so rule caches hash and compare them
    by identity (C speed). Create them with ``DTensorSpec(mesh, placements, shape)``."""

    __slots__ = ("mesh", "placements", "shape", "has_partial", "_local", "__weakref__")
    _interned: dict[tuple, DTensorSpec] = {}

    def __new__(cls, mesh: DeviceMesh, placements: tuple[Placement, ...],
                shape: torch.Size | Sequence[int]) -> DTensorSpec:
        shape = shape if type(shape) is torch.Size else torch.Size(shape)
        if _is_compiling():  # traced: the interned spec is a constant of the graph
            return _interned_spec(mesh, _encode(placements), tuple(shape))
        return cls._intern(mesh, placements, shape)

    @classmethod
    def _intern(cls, mesh: DeviceMesh, placements: tuple[Placement, ...],
                shape: torch.Size) -> DTensorSpec:
        # keyed by mesh identity: an equal mesh built after a process-group restart carries
        # new group handles and must not get a spec holding the old mesh
        key = (id(mesh), placements, shape)
        spec = cls._interned.get(key)
        if spec is None:
            spec = object.__new__(cls)
            spec.mesh = mesh
            spec.placements = placements
            spec.shape = shape
            spec.has_partial = any(type(p) is Partial for p in placements)
            spec._local = None
            cls._interned[key] = spec
        return spec

    def local_shape_and_offset(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Shape and global offset of this rank's shard."""
        if self._local is None:
            self._local = local_shape_and_offset(tuple(self.shape), self.placements, self.mesh)
        return self._local

    def __repr__(self) -> str:
        return f"DTensorSpec({self.mesh!r}, {self.placements}, {tuple(self.shape)})"


_make_wrapper = torch.Tensor._make_wrapper_subclass


def _wrap_traced(local: torch.Tensor, spec: DTensorSpec) -> DTensor:
    # a stand-in of the global shape (one element, expanded): Dynamo reads sizes from the
    # Python overrides and strides from the tensor, so the two must describe one shape
    r = local.new_zeros(()).expand(spec.shape).as_subclass(TracedDTensor)
    r._local = local
    r._spec = spec
    return r


def _wrap(local: torch.Tensor, spec: DTensorSpec) -> DTensor:
    if _is_compiling():
        return _wrap_traced(local, spec)
    r = _make_wrapper(_Shell, spec.shape, dtype=local.dtype, device=local.device)
    r.__class__ = DTensor
    r._local = local
    r._spec = spec
    return r


class DTensor(torch.Tensor):
    """A distributed tensor: ``to_local()`` is this rank's shard, ``placements`` say how the
    logical tensor of global ``shape`` is laid out over ``device_mesh``."""

    __slots__ = ("_local", "_spec", "_grad_view")  # faster than instance-dict attributes
    _local: torch.Tensor
    _spec: DTensorSpec
    _grad_view: DTensor | None

    @staticmethod
    def __new__(cls, local_tensor: torch.Tensor, spec: DTensorSpec, *,
                requires_grad: bool = False) -> DTensor:
        if requires_grad != local_tensor.requires_grad:
            local_tensor = local_tensor.detach().requires_grad_(requires_grad)
        return _wrap(local_tensor, spec)

    # -------------------------------------------------------------- metadata (fast paths)
    @property
    def placements(self) -> tuple[Placement, ...]:
        return self._spec.placements

    @property
    def device_mesh(self) -> DeviceMesh:
        return self._spec.mesh

    @property
    def shape(self) -> torch.Size:  # type: ignore[override]
        return self._spec.shape

    def size(self, dim: int | None = None):  # type: ignore[override]
        return self._spec.shape if dim is None else self._spec.shape[dim]

    def dim(self) -> int:
        return len(self._spec.shape)

    @property
    def ndim(self) -> int:  # type: ignore[override]
        return len(self._spec.shape)

    def numel(self) -> int:
        return self._spec.shape.numel()

    @property
    def dtype(self) -> torch.dtype:  # type: ignore[override]
        return self._local.dtype

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return self._local.device

    @property
    def requires_grad(self) -> bool:  # type: ignore[override]
        return self._local.requires_grad

    @requires_grad.setter
    def requires_grad(self, value: bool) -> None:
        self._local.requires_grad = value

    def requires_grad_(self, requires_grad: bool = True) -> DTensor:  # type: ignore[override]
        self._local.requires_grad_(requires_grad)
        return self

    @property
    def is_leaf(self) -> bool:  # type: ignore[override]
        return self._local.is_leaf

    @property
    def grad_fn(self):  # type: ignore[override]
        return self._local.grad_fn

    @property
    def grad(self) -> DTensor | None:  # type: ignore[override]
        g = self._local.grad
        if g is None:
            self._grad_view = None
            return None
        # One wrapper per gradient tensor, so ``p.grad is p.grad`` (and two modules tied to one
        # parameter see one ``.grad`` object) as with torch's DTensor. Dropped when the grad is.
        view = getattr(self, "_grad_view", None)
        if view is not None and view._local is g:
            return view
        spec = self._spec
        placements = grad_placements_of(spec.placements)
        if placements != spec.placements:
            spec = DTensorSpec(spec.mesh, placements, spec.shape)
        self._grad_view = view = _wrap(g, spec)
        return view

    @grad.setter
    def grad(self, value: DTensor | None) -> None:
        self._grad_view = None
        if value is None:
            self._local.grad = None
            return
        if not isinstance(value, DTensor):
            raise TypeError(f"the grad of a DTensor must be a DTensor or None, got {type(value)}")
        want = grad_placements_of(self._spec.placements)
        self._local.grad = value._redistributed_local(want)

    def detach(self) -> DTensor:  # type: ignore[override]
        return _wrap(self._local.detach(), self._spec)

    def backward(self, gradient: Any = None, retain_graph: Any = None,  # type: ignore[override]
                 create_graph: bool = False, inputs: Any = None) -> None:
        if gradient is not None:
            if not isinstance(gradient, DTensor):
                raise TypeError("backward(gradient=...) of a DTensor takes a DTensor")
            gradient = gradient._redistributed_local(grad_placements_of(self._spec.placements))
        if inputs is not None:
            inputs = [i._local if isinstance(i, DTensor) else i for i in inputs]
        torch.autograd.backward(self._local, gradient, retain_graph, create_graph,
                                inputs=inputs)

    def __repr__(self) -> str:  # type: ignore[override]
        return (f"DTensor(local_tensor={self._local}, device_mesh={self._spec.mesh!r}, "
                f"placements={self._spec.placements})")

    def __hash__(self) -> int:  # type: ignore[override]
        return id(self)

    def __len__(self) -> int:
        return self._spec.shape[0]

    def __reduce_ex__(self, protocol: int):  # type: ignore[override]
        raise TypeError("a DTensor cannot be pickled; send to_local() or full_tensor() instead")

    def __deepcopy__(self, memo: dict) -> DTensor:
        local = self._local.detach().clone().requires_grad_(self._local.requires_grad)
        out = _wrap(local, self._spec)
        if getattr(self, "_is_param", False):
            out._is_param = True
        memo[id(self)] = out
        return out

    # -------------------------------------------------------------- conversions
    @staticmethod
    def from_local(local_tensor: torch.Tensor, device_mesh: DeviceMesh | None = None,
                   placements: Sequence[Placement] | None = None, *, run_check: bool = False,
                   shape: Sequence[int] | None = None,
                   stride: Sequence[int] | None = None,
                   grad_placements: Sequence[Placement] | None = None) -> DTensor:
        """Wrap this rank's ``local_tensor`` as a DTensor (differentiable, no communication
        unless ``run_check``).

        The global ``shape`` defaults to the local shape times the mesh size along every
        sharded dim (even shards); pass ``shape`` for uneven shards, or ``run_check=True`` to
        check that every rank's local shape agrees (as torch does; uneven shards need
        ``shape``) and to make replicas equal: they are broadcast from the first rank of each
        mesh dim. ``grad_placements``: the layout the gradient flowing back into
        ``local_tensor`` takes (default: these placements, Partial read as Replicate)."""
        if isinstance(local_tensor, DTensor):
            refuse_dtensor_in_from_local("torch.Tensor")
        mesh = _require_mesh(device_mesh, "DTensor.from_local")
        given = shape is not None
        local_shape = local_tensor.shape  # a torch.Size is a tuple
        placements, gshape = from_local_layout(local_shape, mesh, placements, shape, run_check)
        spec = DTensorSpec(mesh, placements, gshape)
        # a wrong piece of a given shape would read as a wrong tensor (not checked when
        # compiled: the graph's shapes were checked when it was traced)
        if given and not _is_compiling():
            check_local_shape(local_shape, spec.local_shape_and_offset()[0], gshape,
                              placements, mesh)
        if run_check and any(type(p) is Replicate for p in placements):
            local_tensor = _BroadcastReplicas.apply(local_tensor, mesh, placements)
        if grad_placements is not None:
            gp, want = grad_target(grad_placements, placements, mesh.ndim, len(gshape))
            if gp != want and local_tensor.requires_grad and torch.is_grad_enabled():
                # backward: the gradient (laid out as `want`) is redistributed to `gp`
                local_tensor = _ToLocal.apply(local_tensor, spec, want, gp)
        # checked at its first gather, where the ranks communicate anyway; not when compiled
        # (a graph holds no per-tensor records; torch's DTensor trusts the shapes too)
        if not given and not run_check and not _is_compiling():
            note_inferred(local_tensor, mesh, placements,
                          "DTensor.from_local(run_check=False) without shape=")
        return _wrap(local_tensor, spec)

    @property
    def _local_tensor(self) -> torch.Tensor:
        """torch's private name for the local shard, which code written against torch's
        DTensor reads (torchtitan's checkpointer does): the same tensor as ``to_local()``
        without its autograd boundary."""
        return self._local

    # ------------------------------------------------ torch.distributed.checkpoint (DCP)
    def _dcp_piece(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        for p in self._spec.placements:
            if type(p) is not Shard and type(p) is not Replicate:
                raise ValueError(
                    f"torch.distributed.checkpoint: a DTensor with placements "
                    f"{self._spec.placements} holds no piece of its value ({p} is not Shard or "
                    f"Replicate); redistribute it to Shard/Replicate before saving or loading")
        return self._spec.local_shape_and_offset()

    def __create_write_items__(self, fqn: str, obj: Any) -> list[Any]:
        """DCP save: one write item for this rank's piece (see :mod:`hyperpar.platform.dcp`)."""
        from hyperpar.platform.dcp import write_items

        _shape, offset = self._dcp_piece()
        return write_items(fqn, tuple(self._spec.shape), self._local, offset)

    def __create_chunk_list__(self) -> list[Any]:
        """DCP load: the chunk of the global tensor this rank's piece covers."""
        from hyperpar.platform.dcp import chunk_list

        return chunk_list(*self._dcp_piece())

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        """DCP: this rank's piece; DCP copies into it in place when loading."""
        self._dcp_piece()
        return self._local

    def to_local(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        """This rank's shard. With ``grad_placements``, the gradient flowing back into the
        returned tensor is taken to be laid out that way (e.g. ``[Partial()]``) and is
        redistributed to this DTensor's layout in backward."""
        if grad_placements is None:
            return self._local
        spec = self._spec
        gp, want = grad_target(grad_placements, spec.placements, spec.mesh.ndim,
                               len(spec.shape))
        if gp == want or not (self._local.requires_grad and torch.is_grad_enabled()):
            return self._local
        return _ToLocal.apply(self._local, spec, gp, want)

    def _redistributed_local(self, placements: tuple[Placement, ...]) -> torch.Tensor:
        spec = self._spec
        return redistribute_autograd(self._local, spec.mesh, spec.placements, placements,
                                     tuple(spec.shape))

    def redistribute(self, device_mesh: DeviceMesh | None = None,
                     placements: Sequence[Placement] | None = None, *,
                     async_op: bool = False, forward_dtype: torch.dtype | None = None,
                     backward_dtype: torch.dtype | None = None) -> DTensor:
        """The same logical tensor laid out as ``placements`` (differentiable).

        ``forward_dtype``: run the collective (and return the result) in this dtype;
        ``backward_dtype``: run the backward collective in this dtype (the gradient comes back
        in this DTensor's dtype). Both default to this DTensor's dtype (torch semantics)."""
        if forward_dtype is not None or backward_dtype is not None:
            return self._redistribute_cast(device_mesh, placements, forward_dtype,
                                           backward_dtype)
        spec = self._spec
        dst = self._redistribute_target(device_mesh, placements)
        if dst == spec.placements:
            return self
        local = self._redistributed_local(dst)
        return _wrap(local, DTensorSpec(spec.mesh, dst, spec.shape))

    def _redistribute_target(self, device_mesh: DeviceMesh | None,
                             placements: Any) -> tuple[Placement, ...]:
        """The checked, normalised target placements of a redistribute on this DTensor's mesh."""
        spec = self._spec
        return redistribute_target(spec.mesh, spec.placements, len(spec.shape), device_mesh,
                                   placements)

    def _redistribute_cast(self, device_mesh: DeviceMesh | None, placements: Any,
                           forward_dtype: torch.dtype | None,
                           backward_dtype: torch.dtype | None) -> DTensor:
        spec = self._spec
        dst = self._redistribute_target(device_mesh, placements)
        local = self._local
        fwd, bwd = forward_dtype or local.dtype, backward_dtype or local.dtype
        if local.requires_grad and torch.is_grad_enabled():
            out = _CastRedistribute.apply(local, spec.mesh, spec.placements, dst,
                                          tuple(spec.shape), fwd, bwd)
        else:
            out = redistribute_local(local.to(fwd), spec.mesh, spec.placements, dst,
                                     tuple(spec.shape))
        return _wrap(out, DTensorSpec(spec.mesh, dst, spec.shape))

    def full_tensor(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        """The whole logical tensor on every rank (differentiable)."""
        spec = self._spec
        rep = (REPLICATE,) * spec.mesh.ndim
        return self.redistribute(spec.mesh, rep).to_local(grad_placements=grad_placements)

    __torch_function__: Any  # installed by hyperpar.torch.dtensor._ops.dispatch


class TracedDTensor(DTensor):
    """A DTensor made inside ``torch.compile``: ``as_subclass`` of a one-element stand-in
    expanded to the global shape (Dynamo can build that, not a wrapper), carrying ``_local``
    and ``_spec`` like any DTensor. Eager code reads only those two, so it works everywhere a
    DTensor does; its layout queries (strides, contiguity) describe the stand-in."""

    __slots__ = ()


class _Shell(DTensor):
    """The class an eager DTensor is constructed as: ``_make_wrapper_subclass`` demands a
    ``__torch_dispatch__``, while ``DTensor`` keeps torch's default one so that Dynamo traces
    it as a ``__torch_function__`` tensor. ``_wrap`` re-classes the new object to DTensor."""

    __slots__ = ()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(
            f"hyperpar DTensor: {func} reached the dispatcher without a sharding rule (it was "
            "called from C++ past __torch_function__); call it on to_local() tensors instead"
        )


class _ToLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, spec, grad_placements, want):  # type: ignore[override]
        ctx.args = (spec, grad_placements, want)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        spec, gp, want = ctx.args
        return (redistribute_local(grad, spec.mesh, gp, want, tuple(spec.shape)), None, None,
                None)


class _CastRedistribute(torch.autograd.Function):
    """Redistribution whose forward collective runs in ``fwd`` and backward in ``bwd``."""

    @staticmethod
    def forward(ctx, x, mesh, src, dst, shape, fwd, bwd):  # type: ignore[override]
        ctx.args = (mesh, src, dst, shape, bwd, x.dtype)
        return redistribute_local(x.detach().to(fwd), mesh, src, dst, shape)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        mesh, src, dst, shape, bwd, in_dtype = ctx.args
        g = redistribute_local(grad.to(bwd), mesh, grad_placements_of(dst),
                               grad_placements_of(src), shape)
        return g.to(in_dtype), None, None, None, None, None, None


class _BroadcastReplicas(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mesh, placements):  # type: ignore[override]
        out = x.detach().clone()
        for m, p in enumerate(placements):
            if type(p) is Replicate and mesh.shape[m] > 1:
                get_platform().broadcast(out, mesh.group_ranks(m)[0], mesh.get_group(m))
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad, None, None


def distribute_tensor(tensor: torch.Tensor, device_mesh: DeviceMesh | None = None,
                      placements: Sequence[Placement] | None = None, *,
                      src_data_rank: int | None = 0) -> DTensor:
    """Lay out the full ``tensor`` over ``device_mesh`` as ``placements``.

    With ``src_data_rank=k`` (default 0) the data of the rank at index ``k`` of every mesh dim
    is used (it is broadcast); with ``None`` every rank keeps its own copy and only slices it.
    The result is a leaf that requires grad iff ``tensor`` does."""
    mesh = _require_mesh(device_mesh, "distribute_tensor")
    is_dtensor = isinstance(tensor, DTensor)
    placements = distribute_target(
        mesh, placements, tensor.ndim, src_data_rank,
        given=(tensor.device_mesh, tensor.placements) if is_dtensor else None)
    if placements is None:  # already laid out so: torch returns it as it is
        return tensor
    requires_grad = tensor.requires_grad
    full = tensor.detach()
    if src_data_rank is not None:
        full = full.contiguous().clone()
        for m in range(mesh.ndim):
            if mesh.shape[m] > 1:
                get_platform().broadcast(full, mesh.group_ranks(m)[src_data_rank],
                                         mesh.get_group(m))
    spec = DTensorSpec(mesh, placements, tensor.shape)
    local = redistribute_local(full, mesh, (REPLICATE,) * mesh.ndim, placements,
                               tuple(tensor.shape))
    if local is full and src_data_rank is None:
        local = local.clone()
    return _wrap(local.requires_grad_(requires_grad), spec)


__all__ = ["DTensor", "DTensorSpec", "distribute_tensor", "Partial", "Replicate", "Shard"]
