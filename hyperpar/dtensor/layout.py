"""Layouts, written once for every framework: which rank holds which piece of a tensor, and the
steps that turn one placement tuple into another. Imports no framework.

A plan is a list of steps, one collective (or local op) on one mesh dimension each; each step is
``(kind, mesh_dim, placements_before, arg1, arg2)``:

=================  ===============================  ==========================
transition         step (``kind``)                  collective
=================  ===============================  ==========================
Shard(i) -> R      ``gather``  (i, None)            all-gather (padded if uneven)
Partial -> R       ``allreduce`` (op, None)         all-reduce
Partial -> S(i)    ``reduce_scatter`` (i, op)       reduce-scatter (padded)
R -> Shard(i)      ``chunk`` (i, None)              none (local slice)
S(i) -> S(j)       ``all_to_all`` (i, j)            all-to-all (uneven splits)
R -> Partial       ``to_partial`` (op, None)        none (rank 0 keeps, others 0)
=================  ===============================  ==========================

Nested sharding (several mesh dims sharding one tensor dim) follows mesh-dim order: mesh dim 0
takes the outer chunk. The planner therefore un-shards from the innermost mesh dim outwards,
then shards from the outermost inwards. A plan depends only on the mesh's shape and the two
placement tuples. Each framework's platform executes the steps with its own collectives.
"""

from __future__ import annotations

import itertools
from typing import Any

from .placement import REPLICATE, Partial, Placement, Replicate, Shard, chunk_bounds

Step = tuple  # (kind, mesh_dim, placements_before, arg1, arg2)

#: The step kinds a plan may contain (see the module docstring).
STEP_KINDS = ("gather", "allreduce", "reduce_scatter", "chunk", "all_to_all", "to_partial")


def _shards(placements: tuple[Placement, ...], d: int, skip: int | None = None,
            above: int = -1) -> bool:
    return any(type(p) is Shard and p.dim == d for m, p in enumerate(placements)
               if m != skip and m > above)


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


def shard_shape_and_offset(shape: tuple[int, ...], placements: tuple[Placement, ...],
                           mesh_shape: tuple[int, ...], coord: list[int] | tuple[int, ...] | None
                           ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shape and global offset of the shard at mesh coordinate ``coord`` (``None``: a rank
    outside the mesh, which holds an empty piece)."""
    size = list(shape)
    off = [0] * len(shape)
    if coord is None:
        return (0,) * len(shape), tuple(off)
    for m, p in enumerate(placements):
        if type(p) is Shard:
            o, n = chunk_bounds(size[p.dim], mesh_shape[m], coord[m])
            off[p.dim] += o
            size[p.dim] = n
    return tuple(size), tuple(off)


def local_shape_and_offset(shape: tuple[int, ...], placements: tuple[Placement, ...],
                           mesh: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shape and global offset of this rank's local shard (a mesh with ``_shape`` and
    ``_coordinate``, as :class:`hyperpar.dtensor.mesh.DeviceMesh` has)."""
    return shard_shape_and_offset(shape, placements, mesh._shape, mesh._coordinate)


def shard_slices(shape: tuple[int, ...], placements: tuple[Placement, ...], mesh: Any
                 ) -> tuple[slice, ...]:
    """This rank's piece of a whole tensor of ``shape`` as one slice per dim (``full[...]``
    of them is the local shard)."""
    size, off = local_shape_and_offset(shape, placements, mesh)
    return tuple(slice(o, o + n) for o, n in zip(off, size, strict=True))


#: the value a rank holds instead of a filled constant under a ``Partial`` that would count it
#: more than once: the reduction's identity
_FILL_IDENTITY = {"sum": 0.0, "product": 1.0}


def partial_fill_identity(placements: tuple[Placement, ...], coord: Any) -> float | None:
    """What this rank (at mesh coordinate ``coord``) writes when a constant is filled into a
    tensor laid out as ``placements``: ``None`` for the constant itself, else the identity of
    the pending reduction (``Partial("sum")``: 0, ``Partial("product")``: 1) so that the
    reduction yields the constant once -- only rank 0 of each such mesh dim holds it.
    ``max``/``min``/``avg`` reduce equal terms to the value, so every rank holds it. A sum on
    one mesh dim and a product on another has no such split: raises ``ValueError``."""
    counted = {p.reduce_op for p in placements
               if type(p) is Partial and p.reduce_op in _FILL_IDENTITY}
    if not counted:
        return None
    if len(counted) > 1:
        raise ValueError(
            f"filling a constant into a DTensor laid out as {tuple(placements)}: a pending sum "
            f"on one mesh dim and a pending product on another cannot both yield it; "
            f"redistribute the tensor to Replicate (or Shard) first")
    if all(coord[m] == 0 for m, p in enumerate(placements)
           if type(p) is Partial and p.reduce_op in _FILL_IDENTITY):
        return None
    return _FILL_IDENTITY[counted.pop()]


def _sizes(full: int, n: int) -> list[int]:
    """Every rank's piece length when ``full`` elements are ``Shard``-ed over ``n`` ranks."""
    return [chunk_bounds(full, n, k)[1] for k in range(n)]


def even_global_shape(local_shape: tuple[int, ...], placements: tuple[Placement, ...],
                      mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The global shape ``from_local`` infers without ``shape=``: the local size times the mesh
    size along every sharded dim (even shards, as torch assumes)."""
    size = list(local_shape)
    for m, p in enumerate(placements):
        if type(p) is Shard:
            size[p.dim] *= mesh_shape[m]
    return tuple(size)


def some_rank_empty(shape: tuple[int, ...], placements: tuple[Placement, ...],
                    mesh_shape: tuple[int, ...]) -> bool:
    """Whether some rank's piece of ``shape`` laid out as ``placements`` is empty while others
    are not (the same answer on every rank: it depends only on shapes and placements)."""
    if 0 in shape:
        return False  # empty on every rank: they all skip alike
    return any(0 in shard_shape_and_offset(shape, placements, mesh_shape, c)[0]
               for c in itertools.product(*(range(n) for n in mesh_shape)))


def check_chunk_split(lengths: list[int] | tuple[int, ...], dim: int, what: str = "") -> int:
    """The global length of pieces whose per-rank ``lengths`` along ``dim`` were exchanged;
    raises (the same error on every rank, as every rank holds the same ``lengths``) unless they
    are ``torch.chunk``'s split of their sum -- what ``Shard(dim)`` means."""
    full, n = sum(lengths), len(lengths)
    want = _sizes(full, n)
    if list(lengths) != want:
        at = f"{what}: " if what else ""
        raise ValueError(
            f"{at}the local pieces laid out as Shard({dim}) have lengths {list(lengths)} across "
            f"the {n} ranks, but Shard({dim}) of a dim of size {full} means torch.chunk's "
            f"pieces {want}; split the full tensor with torch.chunk (earlier ranks hold the "
            f"longer pieces: ceil(size / {n}), the tail shorter) or pass a DTensor")
    return full


def input_layout_problem(layout: Placement, shapes: list[tuple[int, ...]], ranks: list[int],
                         differ: list[int], varies: bool, where: str) -> str | None:
    """What is wrong with plain inputs meant to be laid out as ``layout`` over a 1-D mesh, or
    None when they fit. ``shapes``: every rank's shape (in mesh order, ``ranks`` their global
    ranks); ``differ``: the ranks whose tensor differs from the first rank's; ``varies``: this
    rank's tensor holds more than one distinct value (identical constant pieces are legitimate).
    Every rank holds the same arguments, so every rank gets the same answer."""
    n = len(shapes)
    listing = ", ".join(f"rank {r}: {s}" for r, s in zip(ranks, shapes, strict=True))
    if type(layout) is Replicate:
        if not differ:
            return None
        what = f"shapes {listing}" if len(set(shapes)) > 1 else "different values"
        return (f"{where}: the input must be replicated (the same tensor on every rank of the "
                f"mesh), but rank(s) {', '.join(map(str, differ))} hold a different one than "
                f"rank {ranks[0]} ({what}). Feed every tensor-parallel rank the same batch "
                f"(split data over a data-parallel mesh dim instead), or declare the input's "
                f"real layout in the plan (input_layouts=)")
    if type(layout) is not Shard:
        return None
    nd = len(shapes[0])
    d = layout.dim % nd if nd else 0
    others = {s[:d] + s[d + 1:] for s in shapes}
    sizes = [s[d] if len(s) > d else 0 for s in shapes]
    total = sum(sizes)
    chunked = _sizes(total, n)
    if len({len(s) for s in shapes}) > 1 or len(others) > 1 or sizes != chunked:
        return (f"{where}: the input must be this rank's {layout} piece of one tensor "
                f"(torch.chunk's split: lengths {chunked} along dim {d} for a total of {total}), "
                f"but the ranks hold shapes {listing}. Pass each rank its own chunk, e.g. "
                f"x.tensor_split({n}, dim={d})[rank]")
    if n > 1 and not differ and varies:
        return (f"{where}: the input must be this rank's {layout} piece of one tensor, but every "
                f"rank holds the same values (shapes {listing}): was the full tensor passed "
                f"instead of this rank's shard? That makes the global length {total}, {n} times "
                f"the real one. Pass x.tensor_split({n}, dim={d})[rank]")
    return None
