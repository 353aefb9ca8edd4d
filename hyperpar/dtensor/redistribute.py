"""Redistribution: turn a local shard laid out as ``src`` placements into the local shard of
``dst`` placements, on n-D meshes, for uneven shards, differentiably.

A plan is a list of steps, one collective (or local op) on one mesh dimension each:

=================  ===============================  ==========================
transition         step                             collective
=================  ===============================  ==========================
Shard(i) -> R      ``gather``                       all-gather (padded if uneven)
Partial -> R       ``allreduce``                    all-reduce
Partial -> S(i)    ``reduce_scatter``               reduce-scatter (padded)
R -> Shard(i)      ``chunk``                        none (local slice)
S(i) -> S(j)       ``all_to_all``                   all-to-all (uneven splits)
R -> Partial       ``to_partial``                   none (rank 0 keeps, others 0)
=================  ===============================  ==========================

Nested sharding (several mesh dims sharding one tensor dim) follows mesh-dim order: mesh dim 0
takes the outer chunk. The planner therefore un-shards from the innermost mesh dim outwards,
then shards from the outermost inwards. A plan depends only on the mesh's shape and the two
placement tuples, so it is cached per ``(mesh shape, src, dst)`` in a bounded LRU cache (the
tensor shape is not part of the key: a training loop over many sequence lengths reuses one
plan). Inside ``torch.compile`` the cache is bypassed: the plan is a pure function Dynamo traces
as constants, and some torch releases (2.6, 2.9) cannot trace a dict lookup keyed by placements.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from hyperpar.platform import get_platform

from . import _shape_check
from .placement import REPLICATE, Partial, Placement, Replicate, Shard, chunk_bounds

if TYPE_CHECKING:
    from .mesh import DeviceMesh

Step = tuple  # (kind, mesh_dim, placements_before, arg1, arg2)

PLAN_CACHE_SIZE = 1024  # distinct (mesh shape, src, dst) triples kept; least recent evicted


def _shards(placements: tuple[Placement, ...], d: int, skip: int | None = None,
            above: int = -1) -> bool:
    return any(type(p) is Shard and p.dim == d for m, p in enumerate(placements)
               if m != skip and m > above)


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


def _plan(mesh_shape: tuple[int, ...], src: tuple[Placement, ...], dst: tuple[Placement, ...]
          ) -> tuple[Step, ...]:
    ndim = len(src)
    cur = list(src)
    change = {m for m in range(ndim) if not _same(src[m], dst[m]) and mesh_shape[m] > 1}
    # Inner mesh dims sharding a tensor dim that an outer changing dim touches must be undone
    # first (and redone afterwards) to keep the nesting order.
    unshard: set[int] = set()
    grew = True
    while grew:
        grew = False
        for m in sorted(change | unshard):
            dims = {p.dim for p in (src[m], dst[m]) if type(p) is Shard}
            for m2 in range(m + 1, ndim):
                if m2 not in unshard and type(src[m2]) is Shard and src[m2].dim in dims \
                        and mesh_shape[m2] > 1:
                    unshard.add(m2)
                    grew = True
    steps: list[Step] = []
    for m in sorted(change | unshard, reverse=True):
        c = cur[m]
        t = dst[m] if m in change else REPLICATE
        if type(c) is Shard:
            if (type(t) is Shard and m not in unshard and t.dim != c.dim
                    and not _shards(tuple(cur), c.dim, skip=m) and not _shards(dst, c.dim, skip=m)
                    and not _shards(tuple(cur), t.dim, skip=m)
                    and not _shards(dst, t.dim, skip=m)):
                steps.append(("all_to_all", m, tuple(cur), c.dim, t.dim))
                cur[m] = t
            else:
                steps.append(("gather", m, tuple(cur), c.dim, None))
                cur[m] = REPLICATE
        elif type(c) is Partial:
            if (type(t) is Shard and not _shards(tuple(cur), t.dim, above=m)
                    and not _shards(dst, t.dim, above=m)
                    and all(_same(cur[k], dst[k])
                            or not (_is_s(cur[k], t.dim) or _is_s(dst[k], t.dim))
                            for k in range(m))):
                steps.append(("reduce_scatter", m, tuple(cur), t.dim, c.reduce_op))
                cur[m] = t
            else:
                steps.append(("allreduce", m, tuple(cur), c.reduce_op, None))
                cur[m] = REPLICATE
    for m in range(ndim):
        if _same(cur[m], dst[m]) or mesh_shape[m] == 1:
            continue
        t = dst[m]
        assert type(cur[m]) is Replicate, (src, dst, cur)
        if type(t) is Shard:
            steps.append(("chunk", m, tuple(cur), t.dim, None))
        elif type(t) is Partial:
            if t.reduce_op == "product":  # no exact split of a value into n factors
                raise ValueError(
                    f"cannot redistribute to {t!r}: a replicated value has no exact split into "
                    f"a product of per-rank terms (torch refuses it too); use Partial('sum')"
                )
            steps.append(("to_partial", m, tuple(cur), t.reduce_op, None))
        cur[m] = t
    return tuple(steps)


def _same(a: Placement, b: Placement) -> bool:
    """``a == b`` without the cross-type comparison: a dataclass ``__eq__`` answers
    NotImplemented for another type, which Dynamo 2.6 traced as a truthy value (no fallback to
    identity), so the compiled planner dropped steps."""
    return type(a) is type(b) and a == b


def _is_s(p: Placement, d: int) -> bool:
    return type(p) is Shard and p.dim == d


def _size_at(shape: tuple[int, ...], placements: tuple[Placement, ...], coord: list[int],
             mesh_shape: tuple[int, ...], upto: int, d: int) -> int:
    """Size along tensor dim ``d`` after the chunks of mesh dims ``< upto``."""
    size = shape[d]
    for m in range(upto):
        p = placements[m]
        if type(p) is Shard and p.dim == d:
            size = chunk_bounds(size, mesh_shape[m], coord[m])[1]
    return size


def local_shape_and_offset(shape: tuple[int, ...], placements: tuple[Placement, ...],
                           mesh: DeviceMesh) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shape and global offset of this rank's local shard."""
    size = list(shape)
    off = [0] * len(shape)
    coord = mesh._coordinate
    if coord is None:
        return (0,) * len(shape), tuple(off)
    for m, p in enumerate(placements):
        if type(p) is Shard:
            o, n = chunk_bounds(size[p.dim], mesh._shape[m], coord[m])
            off[p.dim] += o
            size[p.dim] = n
    return tuple(size), tuple(off)


def _sizes(full: int, n: int) -> list[int]:
    """Every rank's piece length when ``full`` elements are ``Shard``-ed over ``n`` ranks."""
    return [chunk_bounds(full, n, k)[1] for k in range(n)]


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
