"""DTensors on two meshes over the same devices, dims in another order, meet in one op: each
input is re-expressed on one of the meshes when the neutral :mod:`hyperpar.dtensor.remesh`
says the layout survives the move; else the op refuses as before."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hyperpar.dtensor.mesh import DeviceMesh
from hyperpar.dtensor.remesh import moved_placements, transpose_of
from hyperpar.torch.dtensor.api import DTensor, DTensorSpec, _wrap


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
