"""Meshes over the same devices with their dims in another order: which permutation maps one
onto the other, and whether a layout survives the move (written once; imports no framework).

``fully_shard`` x TP lays a colwise weight out on ``("tp", "dp")`` (both split dim 0, the TP
split outermost; torch writes it ``_StridedShard`` on ``("dp", "tp")``) and a rowwise weight on
``("dp", "tp")``. An op whose DTensor inputs live on such transposed meshes (``clip_grad_norm_``
stacking their norms) can re-express each input on one mesh -- the same local tensor, the
placements moved with their mesh dims -- when that keeps the layout (no tensor dim split by two
mesh dims whose order would swap, no two different pending reductions reordered).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from .mesh import DeviceMesh
from .placement import Partial, Placement, Shard

__all__ = ["moved_placements", "transpose_of"]

_PERMS: dict[tuple[DeviceMesh, DeviceMesh], tuple[int, ...] | None] = {}


def _rank_at(mesh: DeviceMesh, index: Sequence[int]) -> int:
    flat = 0
    for i, size in zip(index, mesh._shape, strict=True):
        flat = flat * size + i
    return mesh._ranks[flat]


def transpose_of(src: DeviceMesh, dst: DeviceMesh) -> tuple[int, ...] | None:
    """``perm`` such that ``dst`` dim ``i`` is ``src`` dim ``perm[i]`` (the whole rank grid
    transposed, checked on every position, so every rank answers alike), or None."""
    key = (src, dst)  # equal meshes have equal grids
    if key in _PERMS:
        return _PERMS[key]
    found = None
    if src.ndim == dst.ndim and src.device_type == dst.device_type \
            and sorted(src._ranks) == sorted(dst._ranks):
        names_s, names_d = src.mesh_dim_names or (), dst.mesh_dim_names or ()
        # a dim of the same name first: equal sizes alone would be ambiguous
        order = sorted(itertools.permutations(range(src.ndim)), key=lambda p: -sum(
            bool(names_s) and bool(names_d) and names_s[j] == names_d[i]
            for i, j in enumerate(p)))
        for perm in order:
            if any(src._shape[j] != dst._shape[i] for i, j in enumerate(perm)):
                continue
            if all(_rank_at(dst, idx) == _rank_at(src, [idx[perm.index(j)]
                                                        for j in range(src.ndim)])
                   for idx in itertools.product(*(range(s) for s in dst._shape))):
                found = tuple(perm)
                break
    _PERMS[key] = found
    return found


def moved_placements(placements: Sequence[Placement], perm: Sequence[int]
                     ) -> tuple[Placement, ...] | None:
    """The placements on the transposed mesh, or None where moving them changes the layout."""
    for dim in {p.dim for p in placements if isinstance(p, Shard)}:
        order = [perm.index(j) for j, p in enumerate(placements)
                 if isinstance(p, Shard) and p.dim == dim]
        if order != sorted(order):  # nested splits of one dim would swap outer and inner
            return None
    ops = {p.reduce_op for p in placements if isinstance(p, Partial)}
    if len(ops) > 1:
        partial = [j for j, p in enumerate(placements) if isinstance(p, Partial)]
        if [perm.index(j) for j in partial] != sorted(perm.index(j) for j in partial):
            return None
    return tuple(placements[j] for j in perm)
