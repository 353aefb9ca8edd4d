"""fully_shard's per-mesh sections and ``full_tensor()`` read-back on MindSpore Cells.

Which mesh each parameter shards over is the neutral core's decision
(:func:`hyperpar.fsdp.sections.shard_placement`, shared with torch's ``fully_shard``); this
module groups the Cell's parameters by it (one :class:`~.fully_shard._Unit` per mesh: its own
flat buffer, all-gather and reduce-scatter) and binds ``full_tensor()`` on every shard
``Parameter`` -- the torch read-back idiom of ``p.full_tensor()`` on a fully_shard DTensor.

A parameter already split by a style (an ``ExpertParallel`` expert weight: this rank's experts,
or a tensor-parallel piece) is sharded again within that piece, as torch's FSDP2 does; its
``full_tensor()`` gathers the piece over the fully_shard group, then the piece over the style's
mesh (``redistribute_local`` with the style's recorded placements).
"""

from __future__ import annotations

from collections.abc import Callable
from types import MethodType
from typing import Any

from mindspore import Parameter, Tensor, mint

from hyperpar.dtensor.placement import REPLICATE, Shard
from hyperpar.fsdp.sections import check_style_mesh, mesh_key, shard_placement
from hyperpar.parallel.shard_plan import ParamSlot
from hyperpar.platform import get_platform

from .redistribute import redistribute_local

__all__ = ["attach_shard_full_tensor", "split_by_mesh", "units_of"]


def units_of(cell: Any) -> list[Any]:
    """The fully-sharded units of ``cell`` itself: one per data-parallel mesh its
    parameters shard over (``shard_placement_fn``), none for a Cell fully_shard never saw."""
    units = cell.__dict__.get("_hp_fsdp_sections")
    if units is not None:
        return list(units)
    unit = cell.__dict__.get("_hp_fsdp_unit")
    return [unit] if unit is not None else []


def split_by_mesh(params: list[Parameter], fn: Callable[[Any], Any] | None, mesh: Any,
                  what: str) -> list[tuple[Any, list[int]]]:
    """``[(mesh, indices into params)]``: the unit's mesh first (possibly with no
    parameters), then each other mesh ``fn`` names, in first-use order. Refuses a placement
    other than ``Shard(0)`` (local check: every rank raises alike, before any collective)."""
    if fn is not None and not callable(fn):
        raise TypeError(f"fully_shard: shard_placement_fn must be callable, got "
                        f"{type(fn).__name__}")
    sections: dict[Any, tuple[Any, list[int]]] = {"unit": (mesh, [])}
    for i, p in enumerate(params):
        dim, pmesh = shard_placement(fn, p, p.name, mesh)
        if dim % max(len(p.shape), 1) != 0:
            raise NotImplementedError(
                f"fully_shard({what}): shard_placement_fn gave Shard({dim}) for parameter "
                f"{p.name!r}; fully_shard on MindSpore Cells splits dim 0 only -- return None "
                f"or Shard(0) (with ShardPlacementResult for another mesh)")
        readback = getattr(p, "_hyperpar_readback", None)  # a style split it (EP, TP)
        if readback is not None and any(isinstance(q, Shard) for q in readback[1]):
            check_style_mesh(readback[0], pmesh, p.name)
        key = "unit" if pmesh is mesh else mesh_key(pmesh)
        if mesh is not None and key == mesh_key(mesh):
            key = "unit"
        sections.setdefault(key, (pmesh, []))[1].append(i)
    return list(sections.values())


def _full_tensor(shard: Parameter) -> Tensor:
    """The whole parameter on every rank (a new tensor; a collective on the shard group, then
    on the style's mesh for a parameter a style had split)."""
    slot, group, n, inner = shard._hp_fsdp_readback
    pieces = get_platform().gather_list(Tensor(shard.asnumpy()), group, "full_tensor") \
        if n > 1 else [Tensor(shard.asnumpy())]
    whole = mint.cat(pieces) if len(pieces) > 1 else pieces[0]
    whole = mint.narrow(whole, 0, 0, slot.shape[0]) if whole.shape[0] != slot.shape[0] \
        else whole
    if inner is None:
        return whole
    mesh, placements, shape = inner
    return redistribute_local(whole, mesh, placements, (REPLICATE,) * len(placements), shape)


def attach_shard_full_tensor(shard: Parameter, original: Parameter, slot: ParamSlot,
                             group: Any, n: int) -> None:
    """Bind ``full_tensor()`` on a fully_shard shard (``original``: the Parameter it
    replaced, whose own read-back a style may have recorded)."""
    inner = getattr(original, "_hyperpar_readback", None)
    shard._hp_fsdp_readback = (slot, group, n, inner)
    shard.full_tensor = MethodType(_full_tensor, shard)
