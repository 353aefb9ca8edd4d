"""Data parallelism over one mesh dimension: average gradients across replicas after backward.

``data_parallel(model, mesh, dim="dp")`` changes ``model`` in place (its class becomes a
subclass that adds :meth:`DataParallelModule.no_sync` and
:meth:`DataParallelModule.finish_gradient_sync`; parameter names and ``state_dict`` keys do not
change) and returns it:

* at wrap time every parameter and buffer is broadcast from the first rank of the dp group, so
  replicas start equal;
* during backward, each parameter's gradient is copied into a flat bucket as soon as it has been
  accumulated (``register_post_accumulate_grad_hook``; times ``1/n`` where the library has no
  native average) and ``.grad`` becomes a view of the bucket; a full bucket is all-reduced
  asynchronously, in place, while backward goes on (the first bucket is at most 1 MB, so one
  starts early). Buckets are launched strictly in bucket
  order on every rank, so ranks whose autograd graphs run in a different order still pair their
  collectives correctly;
* at the end of backward (an autograd-engine callback) the remaining buckets are launched and
  every handle is waited on. A parameter
  that received no gradient on this rank contributes zeros (and gets the average); one that
  received none on *any* rank keeps ``.grad is None`` (as in one process, so an optimizer such as
  AdamW leaves it alone): each bucket carries one "had a gradient" flag per parameter, reduced
  with the gradients.

DTensor parameters (tensor-parallel shards) are reduced through their *local* tensor over the dp
group only: their tp layout is untouched. ``with model.no_sync():`` skips the reduction, so
gradients accumulate locally; the first backward outside it averages the accumulated sum, and
:meth:`DataParallelModule.sync_gradients` averages them at once (for pipeline schedules, which run
one backward per microbatch). Use non-reentrant activation checkpointing: reentrant
recomputation runs nested backward passes, which this reducer does not follow.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hyperpar.platform import get_platform

from ._bucket import Bucket, averaging, pack
from .bucket_plan import FIRST_BUCKET_BYTES, plan_buckets, resolve_group  # noqa: F401 (re-exported)

__all__ = ["DataParallelModule", "data_parallel", "finish_gradient_sync", "no_sync"]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor autograd accumulates into: a DTensor's local shard, else the tensor."""
    to_local = getattr(tensor, "to_local", None)
    if to_local is not None and hasattr(tensor, "placements"):
        return to_local()
    return tensor


def _graph_task_id() -> int:
    """Id of the backward pass running now (-1 outside backward; -1 if torch cannot tell)."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current() if current is not None else -1


def engine_callback() -> Any:
    """torch's ``queue_callback`` of the autograd engine (a private API): it runs the end of the
    gradient average after the whole backward. Without it the last buckets would never be
    reduced, so its absence is an error, never a silent fallback."""
    engine = getattr(torch.autograd.Variable, "_execution_engine", None)
    queue_callback = getattr(engine, "queue_callback", None)
    if queue_callback is None:
        raise RuntimeError(
            "data_parallel: this torch "
            f"({torch.__version__}) has no torch.autograd.Variable._execution_engine."
            "queue_callback, which data_parallel needs to finish averaging the gradients at the "
            "end of backward; install a torch version hyperpar supports (see the README)")
    return queue_callback


@dataclass
class _Bucket:
    index: int
    params: list[torch.Tensor]  # local leaf tensors
    offsets: list[int]
    flat: Bucket
    pending: set[int] = field(default_factory=set)  # ids of params not ready yet
    packed: set[int] = field(default_factory=set)  # ids of params whose .grad is a view of it
    #: ids of params packed as zeros (no gradient on this rank in this round)
    zeroed: set[int] = field(default_factory=set)
    #: column of each param's "had a gradient" flag, after the gradients in the buffer
    flag_at: dict[int, int] = field(default_factory=dict)


class _Reducer:
    """Owns the buckets and the per-backward state of one data-parallel module.

    A gradient is packed into its bucket (times ``1/n`` where the library sums) as soon as it
    is accumulated, and ``.grad`` becomes a view of the bucket: the all-reduce works in place,
    nothing is copied back. Each backward gets fresh buffers, so a ``.grad`` the caller kept
    from the previous step is not overwritten."""

    def __init__(self, params: list[torch.Tensor], group: Any, bucket_cap_bytes: int) -> None:
        self.group = group
        self.platform = get_platform()
        self.size = self.platform.world_size(group)
        self.op, self.scale = averaging(group)
        self.sync_enabled = True
        self._in_backward = False
        self._next = 0  # next bucket to launch, in order
        self.buckets: list[_Bucket] = []
        self._where: dict[int, tuple[_Bucket, int]] = {}
        self._handles: list[Any] = []
        self._queue_callback = engine_callback()
        self.leaf_ids: tuple[int, ...] = ()
        #: buckets launched before the end of the last backward (overlapped with it)
        self.launched_during_backward = 0
        # one bucket plan for every framework (bucket_plan.py): filled from the end
        keys = [((p.dtype, p.device), p.numel() * p.element_size()) for p in params]
        for indices in plan_buckets(keys, bucket_cap_bytes):
            self._add_bucket([params[i] for i in indices])
        for p in params:
            self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def _add_bucket(self, params: list[torch.Tensor]) -> None:
        offsets, n = [], 0
        for p in params:
            offsets.append(n)
            n += p.numel()
        # one flag per parameter after the gradients: 1 where this rank had a gradient
        flat = Bucket(1, n + len(params), params[0].dtype, params[0].device, self.group)
        bucket = _Bucket(len(self.buckets), params, offsets, flat,
                         flag_at={id(p): n + i for i, p in enumerate(params)})
        self.buckets.append(bucket)
        for p, off in zip(params, offsets, strict=True):
            self._where[id(p)] = (bucket, off)

    # -------------------------------------------------------------- backward machinery
    def sync_now(self) -> None:
        """Average the current gradients now, outside backward (after ``no_sync``)."""
        if self.size == 1:
            return
        self._abandon()
        self._start_backward(callback=False)
        self.finish()

    def _start_backward(self, callback: bool = True) -> None:
        self._in_backward = True
        self._next = 0
        for b in self.buckets:
            b.pending = {id(p) for p in b.params}
            b.packed = set()
            b.zeroed = set()
            b.flat.reset()
        if callback:
            self._queue_callback(self.finish)

    def _pack(self, bucket: _Bucket, p: torch.Tensor, offset: int) -> None:
        """Copy ``p.grad`` (scaled) into its bucket and make ``p.grad`` that view."""
        block = bucket.flat.block(offset, p.numel())
        had_grad = p.grad is not None
        pack(block, p.grad, self.scale)
        p.grad = block.view(p.shape)
        bucket.packed.add(id(p))
        bucket.flat.block(bucket.flag_at[id(p)], 1).fill_(1.0 if had_grad else 0.0)
        if not had_grad:
            bucket.zeroed.add(id(p))

    def _on_grad(self, param: torch.Tensor) -> None:
        if not self.sync_enabled or self.size == 1:
            return
        if not self._in_backward:
            self._start_backward()
        bucket, offset = self._where[id(param)]
        if id(param) in bucket.pending:
            self._pack(bucket, param, offset)
            bucket.pending.discard(id(param))
        while self._next < len(self.buckets) and not self.buckets[self._next].pending:
            self._launch(self.buckets[self._next])
            self._next += 1

    def before_forward(self, module: nn.Module, args: Any) -> None:
        """Forward pre-hook: a backward that raised before its end callback ran left its
        half-reduced state behind; drop it (forwards run inside backward -- reentrant
        recomputation -- leave it alone)."""
        if self._in_backward and _graph_task_id() == -1:
            self._abandon()
        if _leaf_ids(module) != self.leaf_ids:
            raise RuntimeError(
                f"data_parallel: the parameters of {type(module).__name__} were replaced after "
                "data_parallel() was applied (their gradients would not be averaged); apply "
                "tensor parallelism (parallelize_module) and other parameter changes first, "
                "then data_parallel()")

    def _abandon(self) -> None:
        for bucket in self.buckets:
            if bucket.flat.buffer is not None and not bucket.flat.launched and self.scale:
                bucket.flat.buffer.mul_(1.0 / self.scale)  # packed grads: local values again
            for p in bucket.params:
                if id(p) in bucket.zeroed:
                    p.grad = None  # it had none before this round packed zeros
            bucket.flat.reset()
            bucket.packed = set()
            bucket.zeroed = set()
        self._in_backward = False

    def _launch(self, bucket: _Bucket) -> None:
        # parameters that got no gradient in this backward: their current .grad (accumulated
        # earlier) or zeros
        for p, off in zip(bucket.params, bucket.offsets, strict=True):
            if id(p) not in bucket.packed:
                self._pack(bucket, p, off)
        bucket.flat.all_reduce(self.op)

    def finish(self) -> None:
        """Launch what is left and wait for every bucket (``.grad`` already views them)."""
        if not self._in_backward:
            return
        self._in_backward = False
        self.launched_during_backward = self._next
        for bucket in self.buckets[self._next:]:
            self._launch(bucket)
        self._next = len(self.buckets)
        for bucket in self.buckets:
            bucket.flat.wait()
            if bucket.zeroed:
                self._drop_unused(bucket)
            bucket.flat.buffer = None  # next backward packs into a fresh buffer

    @staticmethod
    def _drop_unused(bucket: _Bucket) -> None:
        """``.grad = None`` for the parameters that had no gradient on any rank (their reduced
        flag is 0); only parameters zero-packed here can be such, so only they are read."""
        buffer = bucket.flat.allocate()
        for p in bucket.params:
            if id(p) in bucket.zeroed and buffer[0, bucket.flag_at[id(p)]].item() == 0:
                p.grad = None
        bucket.zeroed = set()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


class DataParallelModule(nn.Module):
    """Mixin class of a module prepared by :func:`data_parallel` (never built directly)."""

    _hp_reducer: _Reducer

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside this block accumulate gradients locally, without averaging;
        the first backward after it averages the accumulated gradients."""
        reducer = self._hp_reducer
        old = reducer.sync_enabled
        reducer.sync_enabled = False
        try:
            yield
        finally:
            reducer.sync_enabled = old

    def finish_gradient_sync(self) -> None:
        """Complete the gradient averaging of the last backward now (normally done by an
        autograd callback at the end of backward; calling it again is harmless)."""
        self._hp_reducer.finish()

    def sync_gradients(self) -> None:
        """Average the gradients accumulated so far across the dp group, now.

        For gradients produced by several backward passes under :meth:`no_sync` -- e.g. a
        pipeline schedule, which runs one backward per microbatch::

            with model.no_sync():
                schedule.step(x, target=y)
            model.sync_gradients()
        """
        self._hp_reducer.sync_now()

    @property
    def dp_group(self) -> Any:
        """The process group gradients are averaged over."""
        return self._hp_reducer.group


def data_parallel(model: nn.Module, mesh: Any = None, dim: str | int | None = "dp", *,
                  group: Any = None, bucket_cap_mb: float = 25.0,
                  broadcast_from_first_rank: bool = True) -> nn.Module:
    """Make ``model`` average its gradients over the data-parallel group after backward.

    Args:
        model: a module (plain or tensor-parallelised with DTensor parameters).
        mesh: a :class:`~hyperpar.dtensor.DeviceMesh`; its dimension ``dim`` is the dp group
            (a 1-D mesh may omit ``dim``). Without ``mesh`` and ``group``: the world.
        dim: the mesh dimension name (or index) of the replicas.
        group: a process group from ``get_platform().new_group(...)`` instead of a mesh.
        bucket_cap_mb: gradient bytes per all-reduce bucket.
        broadcast_from_first_rank: copy parameters and buffers from the first dp rank now.

    Returns ``model`` itself, whose class now also derives from :class:`DataParallelModule`.
    """
    if isinstance(model, DataParallelModule):
        raise ValueError(f"data_parallel: {type(model).__name__} is already data-parallel")
    if bucket_cap_mb <= 0:
        raise ValueError(f"data_parallel: bucket_cap_mb must be positive, got {bucket_cap_mb}")
    engine_callback()  # a torch without it: an error here, on every rank, before any collective
    platform = get_platform()
    pg = resolve_group(mesh, dim, group)
    src = platform.group_ranks(pg)[0]
    seen: set[int] = set()
    leaves: list[torch.Tensor] = []
    for name, param in model.named_parameters():
        _check_not_sharded_over(name, param, dim if group is None else None)
        local = _local(param)
        if id(local) in seen:
            continue
        seen.add(id(local))
        if broadcast_from_first_rank and platform.world_size(pg) > 1:
            with torch.no_grad():
                platform.broadcast(local.data, src, pg)
        if param.requires_grad:
            leaves.append(local)
    if broadcast_from_first_rank and platform.world_size(pg) > 1:
        for buf in model.buffers():
            with torch.no_grad():
                platform.broadcast(_local(buf).data, src, pg)
    reducer = _Reducer(leaves, pg, int(bucket_cap_mb * 1024 * 1024))
    reducer.leaf_ids = _leaf_ids(model)
    cls = type(model)
    model.__class__ = type(f"DataParallel{cls.__name__}", (cls, DataParallelModule), {})
    model._hp_reducer = reducer
    reducer._handles.append(platform.register_forward_pre_hook(model, reducer.before_forward))
    return model


def _leaf_ids(model: nn.Module) -> tuple[int, ...]:
    return tuple(id(_local(p)) for p in model.parameters() if p.requires_grad)


def _check_not_sharded_over(name: str, param: torch.Tensor, dim: Any) -> None:
    """A DTensor parameter split over the dp mesh dimension itself cannot be averaged there."""
    if not isinstance(dim, str) or not hasattr(param, "placements"):
        return
    names = getattr(param.device_mesh, "mesh_dim_names", None) or ()
    if dim in names:
        placement = param.placements[names.index(dim)]
        if not placement.is_replicate():
            raise ValueError(
                f"data_parallel: parameter {name!r} is laid out as {placement!r} over mesh "
                f"dimension {dim!r}, the dimension its gradients would be averaged over; "
                f"shard parameters over another dimension (e.g. parallelize_module(model, "
                f"mesh['tp'], plan)) or replicate them over {dim!r}")


def no_sync(model: nn.Module) -> contextlib.AbstractContextManager[None]:
    """``model.no_sync()`` for a data-parallel model (found among its submodules too)."""
    return _find(model).no_sync()


def finish_gradient_sync(model: nn.Module) -> None:
    """``model.finish_gradient_sync()`` for every data-parallel module inside ``model``."""
    for m in model.modules():
        if isinstance(m, DataParallelModule):
            m.finish_gradient_sync()


def _find(model: nn.Module) -> DataParallelModule:
    for m in model.modules():
        if isinstance(m, DataParallelModule):
            return m
    raise ValueError(f"{type(model).__name__} has no data-parallel module; call data_parallel()")
