"""Redistribution: turn a local shard laid out as ``src`` placements into the local shard of
``dst`` placements, on n-D meshes, for uneven shards, differentiably.

The plan -- one collective (or local op) per step, on one mesh dimension each -- comes from the
framework-neutral planner in :mod:`hyperpar.dtensor.layout` (its docstring lists the step kinds);
this module executes it with torch and the platform's collectives. A plan depends only on the
mesh's shape and the two placement tuples, so it is cached per ``(mesh shape, src, dst)`` in
a bounded LRU cache (the tensor shape is not part of the key: a training loop over many
sequence lengths reuses one plan). Inside ``torch.compile`` the cache is bypassed: the plan is a
pure function Dynamo traces as constants, and some torch releases (2.6, 2.9) cannot trace a dict
lookup keyed by placements.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from hyperpar.dtensor.layout import (  # noqa: F401  (re-exported: the planner lives in the neutral layout module)
    STEP_KINDS,
    Step,
    _is_s,
    _plan,
    _same,
    _shards,
    _size_at,
    _sizes,
    local_shape_and_offset,
    shard_shape_and_offset,
)
from hyperpar.dtensor.placement import REPLICATE, Partial, Placement, chunk_bounds
from hyperpar.platform import get_platform
from hyperpar.torch.dtensor import _shape_check

if TYPE_CHECKING:
    from hyperpar.dtensor.mesh import DeviceMesh

PLAN_CACHE_SIZE = 1024  # distinct (mesh shape, src, dst) triples kept; least recent evicted


def plan_redistribute(mesh: DeviceMesh, src: tuple[Placement, ...], dst: tuple[Placement, ...],
                      shape: tuple[int, ...] = ()) -> tuple[Step, ...]:
    """The steps turning ``src`` into ``dst`` on ``mesh`` (cached; see the module docstring).

    ``shape`` (the global tensor shape) is accepted for callers' convenience and not used: the
    steps do not depend on it (:func:`run_plan` takes the sizes it needs)."""
    mesh_shape = tuple(mesh.shape)
    if torch.compiler.is_compiling():
        return _plan(mesh_shape, src, dst)
    return _cached_plan(mesh_shape, tuple(src), tuple(dst))


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def _cached_plan(mesh_shape: tuple[int, ...], src: tuple[Placement, ...],
                 dst: tuple[Placement, ...]) -> tuple[Step, ...]:
    return _plan(mesh_shape, src, dst)


def plan_cache_info() -> functools._CacheInfo:
    """Hits, misses and the current size of the plan cache (``functools.lru_cache`` stats)."""
    return _cached_plan.cache_info()


def run_plan(x: torch.Tensor, plan: tuple[Step, ...], mesh: DeviceMesh,
             shape: tuple[int, ...]) -> torch.Tensor:
    """Execute ``plan`` on the local tensor ``x`` (no autograd)."""
    coord = mesh._coordinate
    mshape = mesh._shape
    for kind, m, before, a, b in plan:
        n = mshape[m]
        group = mesh._groups[m]
        if kind == "gather":
            full = _size_at(shape, before, coord, mshape, m, a)
            x = get_platform().all_gather_along(x, a, group, sizes=_sizes(full, n))
        elif kind == "allreduce":
            x = x.clone(memory_format=torch.contiguous_format)
            get_platform().all_reduce(x, a, group)
        elif kind == "chunk":
            full = x.shape[a]
            x = x.narrow(a, *chunk_bounds(full, n, coord[m])).clone()
        elif kind == "reduce_scatter":
            x = get_platform().reduce_scatter_along(x, a, b, group)
        elif kind == "all_to_all":
            full = _size_at(shape, before, coord, mshape, m, a)
            x = get_platform().all_to_all_along(x, b, a, group, concat_sizes=_sizes(full, n))
        elif kind == "to_partial":
            if a == "sum" and coord[m] != 0:
                x = torch.zeros_like(x)
        else:  # pragma: no cover
            raise AssertionError(kind)
    return x


def redistribute_local(x: torch.Tensor, mesh: DeviceMesh, src: tuple[Placement, ...],
                       dst: tuple[Placement, ...], shape: tuple[int, ...]) -> torch.Tensor:
    """Non-differentiable redistribution of a local tensor."""
    if src == dst:
        return x
    # pieces of an inferred global shape: check before gathering (eager only: see from_local)
    if not torch.compiler.is_compiling() and _shape_check._INFERRED:
        _shape_check.verify_before_gather(x)
    return run_plan(x, plan_redistribute(mesh, src, dst, shape), mesh, shape)


class Redistribute(torch.autograd.Function):
    """Differentiable redistribution. The gradient of a tensor laid out as ``p`` is laid out as
    ``p`` with Partial replaced by Replicate; backward redistributes it back."""

    @staticmethod
    def forward(ctx, x, mesh, src, dst, shape):  # type: ignore[override]
        ctx.args = (mesh, src, dst, shape)
        return redistribute_local(x.detach(), mesh, src, dst, shape)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        mesh, src, dst, shape = ctx.args
        gsrc = tuple(REPLICATE if type(p) is Partial else p for p in src)
        gdst = tuple(REPLICATE if type(p) is Partial else p for p in dst)
        return redistribute_local(grad, mesh, gdst, gsrc, shape), None, None, None, None


def redistribute_autograd(x: torch.Tensor, mesh: DeviceMesh, src: tuple[Placement, ...],
                          dst: tuple[Placement, ...], shape: tuple[int, ...]) -> torch.Tensor:
    """Redistribute ``x``; differentiable when ``x`` requires grad."""
    if src == dst:
        return x
    # pieces of an inferred global shape: check before gathering (eager only: see from_local)
    if not torch.compiler.is_compiling() and _shape_check._INFERRED:
        _shape_check.verify_before_gather(x)
    if x.requires_grad and torch.is_grad_enabled():
        return Redistribute.apply(x, mesh, src, dst, shape)
    return redistribute_local(x, mesh, src, dst, shape)
