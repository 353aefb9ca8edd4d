"""Data parallelism on MindSpore Cells: average gradients across replicas over one mesh dim.

>>> mesh = init_device_mesh((2, 2), mesh_dim_names=("dp", "tp"))          # doctest: +SKIP
>>> parallelize_module(model, mesh["tp"], plan)       # optional: tensor parallelism first
>>> data_parallel(model, mesh, "dp")
>>> opt = nn.Adam(model.trainable_params(), learning_rate=1e-3)
>>> step = ms.value_and_grad(loss_fn, None, opt.parameters)
>>> loss, grads = step(x_local, y_local)      # this replica's part of the batch
>>> opt(model.reduce_gradients(grads))        # averaged over "dp", then the step

The same function and arguments as hyperpar's PyTorch ``data_parallel``. MindSpore has no
``.backward()`` and no gradient hooks on parameters: gradients are the tuple ``value_and_grad``
returns, so averaging is a call on that tuple -- what ``mindspore.nn.DistributedGradReducer``
users write (``grads = grad_reducer(grads)``). Which gradients share a bucket, the averaging op
and the group come from :mod:`hyperpar.parallel.bucket_plan`, shared with the PyTorch version;
this module only flattens, all-reduces and splits MindSpore tensors. Buckets are launched
asynchronously, all of them, then waited on.

Tensor-parallel Cells hold this rank's shard as a plain ``Parameter``: it is averaged over the
dp group as it is, its tp layout untouched. Not having a hook into backward, nothing here
overlaps communication with the gradient computation (MindSpore's graph mode does that on its
own for ``DistributedGradReducer``; hyperpar's MindSpore backend runs PyNative).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from mindspore import Parameter, Tensor, mint, nn

from hyperpar.parallel.bucket_plan import averaging, plan_buckets, resolve_group
from hyperpar.platform import get_platform

__all__ = ["DataParallelCell", "data_parallel", "reduce_gradients"]


class _Reducer:
    """The buckets of one data-parallel Cell and the averaging of a gradient tuple."""

    def __init__(self, params: list[Parameter], group: Any, bucket_cap_bytes: int) -> None:
        self.group = group
        self.params = params
        self.platform = get_platform()
        self.size = self.platform.world_size(group)
        self.op, self.scale = averaging(group)
        items = [(p.dtype, int(np.prod(p.shape, dtype=np.int64)) * p.itemsize) for p in params]
        self.buckets = plan_buckets(items, bucket_cap_bytes)

    def check(self, grads: Sequence[Any]) -> None:
        """Raise (on every rank alike, before any collective) for a tuple that does not match
        the Cell's trainable parameters one to one."""
        if len(grads) != len(self.params):
            raise ValueError(
                f"reduce_gradients: got {len(grads)} gradients for the "
                f"{len(self.params)} trainable parameters of the data-parallel Cell; take the "
                f"gradients over model.trainable_params() (or an optimizer built on them: "
                f"ms.value_and_grad(fn, None, opt.parameters)), in that order")
        for i, (g, p) in enumerate(zip(grads, self.params, strict=True)):
            if g is None or tuple(g.shape) != tuple(p.shape):
                got = None if g is None else tuple(g.shape)
                raise ValueError(
                    f"reduce_gradients: gradient {i} has shape {got} but parameter "
                    f"{p.name!r} has shape {tuple(p.shape)}; pass the gradients in the order "
                    f"of model.trainable_params()")

    def reduce(self, grads: Sequence[Any]) -> tuple[Any, ...]:
        """The gradients averaged over the group, in the order given."""
        self.check(grads)
        if self.size == 1:
            return tuple(grads)
        out: list[Any] = list(grads)
        launched = []
        for indices in self.buckets:
            flat = mint.cat([grads[i].reshape(-1) for i in indices])
            if self.scale is not None:
                flat = flat * self.scale  # no native average: sum of pre-scaled gradients
            work = self.platform.all_reduce(flat, op=self.op, group=self.group, async_op=True)
            launched.append((indices, flat, work))
        for indices, flat, work in launched:
            if work is not None:
                work.wait()
            sizes = [int(np.prod(grads[i].shape, dtype=np.int64)) for i in indices]
            for i, piece in zip(indices, mint.split(flat, sizes), strict=True):
                out[i] = piece.reshape(grads[i].shape)
        return tuple(out)


class DataParallelCell(nn.Cell):
    """Mixin class of a Cell prepared by :func:`data_parallel` (never built directly)."""

    _hp_reducer: _Reducer

    def reduce_gradients(self, grads: Sequence[Any]) -> tuple[Any, ...]:
        """``grads`` (one per ``trainable_params()``, in that order, as ``value_and_grad``
        returns them) averaged over the dp group; returns a new tuple."""
        return self._hp_reducer.reduce(grads)

    @property
    def dp_group(self) -> Any:
        """The process group gradients are averaged over."""
        return self._hp_reducer.group


def data_parallel(model: nn.Cell, mesh: Any = None, dim: str | int | None = "dp", *,
                  group: Any = None, bucket_cap_mb: float = 25.0,
                  broadcast_from_first_rank: bool = True) -> nn.Cell:
    """Make ``model`` a data-parallel Cell: its :meth:`DataParallelCell.reduce_gradients`
    averages a gradient tuple over the dp group.

    Args:
        model: a Cell (plain or tensor-parallelised by ``parallelize_module``).
        mesh: a :class:`~hyperpar.dtensor.DeviceMesh`; its dimension ``dim`` is the dp group
            (a 1-D mesh may omit ``dim``). Without ``mesh`` and ``group``: the world.
        dim: the mesh dimension name (or index) of the replicas.
        group: a process group from ``get_platform().new_group(...)`` instead of a mesh.
        bucket_cap_mb: gradient bytes per all-reduce bucket.
        broadcast_from_first_rank: copy parameters from the first dp rank now.

    Returns ``model`` itself, whose class now also derives from :class:`DataParallelCell`.
    """
    if isinstance(model, DataParallelCell):
        raise ValueError(f"data_parallel: {type(model).__name__} is already data-parallel")
    if not isinstance(model, nn.Cell):
        raise TypeError(f"data_parallel: expected a mindspore.nn.Cell, got "
                        f"{type(model).__name__}")
    if bucket_cap_mb <= 0:
        raise ValueError(f"data_parallel: bucket_cap_mb must be positive, got {bucket_cap_mb}")
    platform = get_platform()
    pg = resolve_group(mesh, dim, group)
    if broadcast_from_first_rank and platform.world_size(pg) > 1:
        src = platform.group_ranks(pg)[0]
        for _name, param in model.parameters_and_names():
            value = Tensor(param.asnumpy())
            platform.broadcast(value, src, pg)
            param.set_data(value)
    reducer = _Reducer(list(model.trainable_params()), pg, int(bucket_cap_mb * 1024 * 1024))
    cls = type(model)
    model.__class__ = type(f"DataParallel{cls.__name__}", (cls, DataParallelCell), {})
    object.__setattr__(model, "_hp_reducer", reducer)
    return model


def reduce_gradients(model: nn.Cell, grads: Sequence[Any]) -> tuple[Any, ...]:
    """``model.reduce_gradients(grads)`` for a data-parallel Cell (found among its cells)."""
    for _name, cell in model.cells_and_names():
        if isinstance(cell, DataParallelCell):
            return cell.reduce_gradients(grads)
    raise ValueError(f"{type(model).__name__} has no data-parallel Cell; call data_parallel()")
