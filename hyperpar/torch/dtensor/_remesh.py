"""DTensors on two meshes over the same devices, dims in another order, meet in one op.

``fully_shard`` x TP lays a colwise weight out on ``("tp", "dp")`` (both split dim 0, the TP
split outermost; torch writes it ``_StridedShard`` on ``("dp", "tp")``) and a rowwise weight on
``("dp", "tp")``. ``clip_grad_norm_`` stacks their norms and scales every gradient by one
coefficient: an op whose DTensor inputs live on such transposed meshes. Each input is
re-expressed on one of the meshes -- the same local tensor, the placements moved with their
mesh dims -- when that keeps the layout (no tensor dim split by two mesh dims whose order
would swap, no two different pending reductions reordered); else the op refuses as before.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from hyperpar.dtensor.mesh import DeviceMesh
from hyperpar.dtensor.placement import Partial, Placement, Shard
from hyperpar.torch.dtensor.api import DTensor, DTensorSpec, _wrap

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


def onto_one_mesh(args: Sequence, kwargs: dict, dts: Sequence[DTensor]
                  ) -> tuple[tuple, dict] | None:
    """``args``/``kwargs`` with every DTensor of ``dts`` on one mesh (views sharing the local
    tensor, so autograd and in-place ops reach the originals), or None if no mesh fits all."""
    meshes: list[DeviceMesh] = []
    for d in dts:
        if d._spec.mesh not in meshes:
            meshes.append(d._spec.mesh)
    for target in meshes:
        table: dict[int, DTensor] = {}
        for d in dts:
            spec = d._spec
            if spec.mesh == target:
                continue
            perm = transpose_of(spec.mesh, target)
            moved = None if perm is None else moved_placements(spec.placements, perm)
            if moved is None:
                break
            table[id(d)] = _wrap(d._local, DTensorSpec(target, moved, spec.shape))
        else:
            return _swap(tuple(args), table), _swap(dict(kwargs), table)
    return None


def _swap(tree: Any, table: dict[int, DTensor]) -> Any:
    if isinstance(tree, DTensor):
        return table.get(id(tree), tree)
    if isinstance(tree, list | tuple):
        out = [_swap(a, table) for a in tree]
        return type(tree)(out) if type(tree) in (list, tuple) else tree
    if isinstance(tree, dict):
        return {k: _swap(v, table) for k, v in tree.items()}
    return tree
