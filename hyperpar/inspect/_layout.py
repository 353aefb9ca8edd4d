"""How one hooked tensor is laid out over the ranks, and its real global shape.

The layout comes from the tensor itself, never from the hook's ``expected_shape``:

* a DTensor (or the gradient of one) carries its spec: mesh, placements, global shape;
* a plain tensor under a tensor-parallel mesh is examined across the TP group: every rank's
  local shape is exchanged; pieces of different sizes are shards along the one dimension where
  they differ; pieces of equal size are compared by value -- equal pieces are a replicated
  tensor, different ones are shards along ``sharded_dim`` (given per hook) or along the one
  dimension where ``expected_shape`` differs from the local shape (a hint that picks the
  dimension; the size along it still comes from the ranks); equal pieces under a
  ``sharded_dim`` raise (gathering them would make copies);
* with a data-parallel dimension, the batch sizes of the replicas are exchanged.

:class:`_Layout` then checks ``expected_shape`` against that global shape -- on every rank,
before any activation is gathered -- and raises :class:`ShapeMismatchError` naming both.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from hyperpar.platform import get_platform


class _Owner(Protocol):
    """What a layout reads of its :class:`~hyperpar.inspect.model.InspectedModel` (a protocol,
    so this module does not import the model module, which imports it)."""

    batch_dim: int
    dp_dim: str | None

    def _tp_mesh(self) -> Any: ...
    def _dp_mesh(self) -> Any: ...


class _Hook(Protocol):
    """What a layout reads of a :class:`~hyperpar.inspect.model.HookFunction`."""

    module_name: str
    sharded_dim: int | None
    expected_shape: Any

__all__ = ["ShapeMismatchError"]


class ShapeMismatchError(ValueError):
    """A hooked activation's global shape differs from the hook's ``expected_shape`` (or its
    layout over the ranks cannot be told from what the ranks hold)."""


def _dtensor_types() -> tuple[type, Any, Any]:
    from hyperpar.dtensor import DTensor, Replicate, Shard

    return DTensor, Replicate, Shard


def _matches(want: Sequence[int | None], shape: Sequence[int]) -> bool:
    return len(want) == len(shape) and all(w is None or w == s for w, s in zip(want, shape,
                                                                                strict=False))


class _Layout:
    """One hooked tensor ``x``: its layout and global shape (established at construction, with
    small collectives over the TP/DP groups), ``full()`` to gather it, ``reshard(full)`` to lay
    an edited full tensor out like ``x`` again (both differentiable)."""

    def __init__(self, owner: _Owner, x: torch.Tensor, name: str, hook: _Hook,
                 grad_of: Any = None, what: str = "the output", gather_dp: bool = True
                 ) -> None:
        DTensor, Replicate, Shard = _dtensor_types()
        self.Replicate, self.Shard = Replicate, Shard
        self.owner, self.x, self.name, self.hook, self.what = owner, x, name, hook, what
        self.batch_dim = owner.batch_dim
        self.dt: Any = None
        self.was_local = True
        self.pieces: list[torch.Tensor] | None = None  # TP shards already gathered (no grad)
        self.how = "not sharded"
        self.tp = owner._tp_mesh()
        self.dp = owner._dp_mesh() if gather_dp else None
        if grad_of is not None:  # x is the local gradient of DTensor grad_of
            from hyperpar.dtensor.placement import grad_placements_of

            self.dt = DTensor.from_local(x, grad_of.device_mesh,
                                         grad_placements_of(tuple(grad_of.placements)),
                                         shape=grad_of.shape)
        elif isinstance(x, DTensor):
            self.dt, self.was_local = x, False
        elif self.tp is not None:
            self._examine_plain(x)
        if self.dt is not None:
            if self.how == "not sharded":
                self.how = (f"a DTensor with placements {tuple(self.dt.placements)} on "
                            f"{self.dt.device_mesh!r}")
            if owner.dp_dim in (self.dt.device_mesh.mesh_dim_names or ()):
                self.dp = None  # a DTensor on a mesh with the dp dim: full_tensor() covers it
        shape = list(self.dt.shape) if self.dt is not None else list(x.shape)
        self.dp_shape: list[int] | None = None
        if self.dp is not None:
            self._exchange_batch(shape)
        self.shape = tuple(int(s) for s in shape)
        self._check()

    # -------------------------------------------------------------- finding the layout
    def _examine_plain(self, x: torch.Tensor) -> None:
        """Set ``self.dt`` when the plain tensor ``x`` is split over the TP group."""
        platform, tp, hook = get_platform(), self.tp, self.hook
        group, n = tp.get_group(0), tp.size()
        shapes = platform.all_gather_object(tuple(x.shape), group)
        nd = x.ndim
        if any(len(s) != nd for s in shapes):
            raise ShapeMismatchError(
                f"inspect: {self.what} of module {self.name!r} has a different number of "
                f"dimensions on the {n} tp ranks (local shapes {shapes}); it is not one tensor "
                "split over tensor parallelism")
        declared = None if hook.sharded_dim is None else hook.sharded_dim % max(nd, 1)
        differ = [d for d in range(nd) if len({s[d] for s in shapes}) > 1]
        if len(differ) > 1 or (differ and declared is not None and declared != differ[0]):
            raise ShapeMismatchError(
                f"inspect: {self.what} of module {self.name!r} has local shapes {shapes} on the "
                f"{n} tp ranks: they differ in dims {differ}"
                + (f", but the hook says sharded_dim={hook.sharded_dim}" if declared is not None
                   else "") + "; a tensor split along one dimension differs only in that one")
        if differ:  # uneven shards: the dimension and the sizes come from the ranks
            dim = differ[0]
            shape = list(x.shape)
            shape[dim] = sum(s[dim] for s in shapes)
        else:
            with torch.no_grad():
                flat = torch.empty(n * x.numel(), dtype=x.dtype, device=x.device)
                platform.all_gather_into_tensor(flat, x.detach().contiguous().view(-1), group)
                pieces = list(flat.view(n, *x.shape).unbind(0))
            equal = all(torch.equal(pieces[0], p) for p in pieces[1:])
            if equal and declared is not None:  # n copies would be gathered: refuse to guess
                raise ShapeMismatchError(
                    f"inspect: {self.what} of module {self.name!r} (hook "
                    f"{hook.module_name!r}) is equal on the {n} tp ranks (local shape "
                    f"{tuple(x.shape)}): a replicated tensor, not one split along "
                    f"sharded_dim={hook.sharded_dim}; hook this module without sharded_dim")
            if equal:
                self.how = f"replicated: equal on the {n} tp ranks"
                return
            dim = declared if declared is not None else self._hinted_dim(x, n)
            shape = list(x.shape)
            shape[dim] *= n
            self.pieces = pieces
        self.how = (f"split over the {n} tp ranks along dim {dim}, local shape "
                    f"{tuple(x.shape)} on this rank")
        DTensor = _dtensor_types()[0]
        self.dt = DTensor.from_local(x, tp, [self.Shard(dim)], shape=shape, run_check=False)

    def _hinted_dim(self, x: torch.Tensor, n: int) -> int:
        """The pieces differ in value: the one dimension (the DP batch dimension excepted) where
        ``expected_shape`` differs from the local shape is the split one."""
        want = self.hook.expected_shape
        skip = self.batch_dim % x.ndim if self.dp is not None and x.ndim else None
        dims = [] if want is None or len(want) != x.ndim else [
            d for d, (w, s) in enumerate(zip(want, x.shape, strict=True))
            if w is not None and w != s and d != skip]
        if len(dims) == 1:
            return dims[0]
        raise ShapeMismatchError(
            f"inspect: {self.what} of module {self.name!r} (hook {self.hook.module_name!r}) "
            f"differs between the {n} tp ranks (local shape {tuple(x.shape)} on each), so it is "
            f"split over tensor parallelism, but along which dimension cannot be told: "
            f"expected_shape is {None if want is None else tuple(want)}. Pass sharded_dim= (the "
            f"split dimension) or the global shape as expected_shape (it then differs from the "
            f"local shape in the split dimension only). If the ranks should hold equal values "
            f"here, the replicas diverged (e.g. dropout seeded differently per rank).")

    def _exchange_batch(self, shape: list[int]) -> None:
        """Replace ``shape``'s batch size by the sum over the data-parallel replicas."""
        from hyperpar.dtensor.placement import chunk_bounds

        if not shape:
            raise ShapeMismatchError(
                f"inspect: {self.what} of module {self.name!r} is a scalar; it cannot be "
                "gathered across data-parallel replicas along a batch dimension")
        bd = self.batch_dim % len(shape)
        sizes = get_platform().all_gather_object(int(shape[bd]), self.dp.get_group(0))
        total = sum(sizes)
        if [chunk_bounds(total, len(sizes), i)[1] for i in range(len(sizes))] != sizes:
            raise ShapeMismatchError(
                f"inspect: {self.what} of module {self.name!r}: the data-parallel replicas hold "
                f"{sizes} rows along batch_dim={self.batch_dim}; gathering needs torch.chunk "
                f"sizes of {total} over {len(sizes)} replicas; split the batch evenly")
        self.dp_shape = list(shape)
        self.dp_shape[bd] = total
        self.how += (f", gathered across {len(sizes)} data-parallel replicas along dim {bd} "
                     f"(rows {sizes})")
        shape[bd] = total

    def _check(self) -> None:
        want = self.hook.expected_shape
        if want is None or _matches(want, self.shape):
            return
        hint = ("pass its global shape as expected_shape (None entries accept any size)")
        if self.how.startswith("replicated"):
            hint += ("; if the output really is split over tensor parallelism, pass "
                     "sharded_dim=")
        raise ShapeMismatchError(
            f"inspect: {self.what} of module {self.name!r} (hook {self.hook.module_name!r}) has "
            f"global shape {self.shape} ({self.how}) but expected_shape is {tuple(want)}; "
            f"{hint}")

    # -------------------------------------------------------------- gather / re-shard
    def full(self) -> torch.Tensor:
        if self.pieces is not None and not torch.is_grad_enabled():
            full = torch.cat(self.pieces, self.dt.placements[0].dim)
        else:
            full = self.dt.full_tensor() if self.dt is not None else self.x
        if self.dp is not None:
            DTensor = _dtensor_types()[0]
            self.dp_dt = DTensor.from_local(full, self.dp, [self.Shard(self.batch_dim)],
                                            shape=self.dp_shape, run_check=False)
            full = self.dp_dt.full_tensor()
        return full

    def reshard(self, full: torch.Tensor) -> torch.Tensor:
        DTensor = _dtensor_types()[0]
        y = full
        if self.dp is not None:
            rep = DTensor.from_local(y, self.dp, [self.Replicate()])
            y = rep.redistribute(self.dp, self.dp_dt.placements).to_local()
        if self.dt is None:
            return y
        mesh = self.dt.device_mesh
        rep = DTensor.from_local(y, mesh, [self.Replicate()] * mesh.ndim)
        out = rep.redistribute(mesh, self.dt.placements)
        return out.to_local() if self.was_local else out

    def is_leader(self) -> bool:
        """Whether this rank keeps the capture (first rank of every gathered dimension)."""
        if self.dt is not None and any(c != 0 for c in self.dt.device_mesh.get_coordinate()):
            return False
        if self.dt is None and self.tp is not None and self.tp.get_local_rank(0) != 0:
            return False
        return self.dp is None or self.dp.get_local_rank(0) == 0
