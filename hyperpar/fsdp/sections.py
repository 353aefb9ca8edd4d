"""Which data-parallel mesh (and dim) each parameter of a ``fully_shard`` unit shards over,
decided once for every framework (no framework import).

``shard_placement_fn(param)`` may return ``None`` (dim 0 on the unit's mesh), ``Shard(dim)``
(hyperpar's or torch's, on the unit's mesh) or ``ShardPlacementResult(placement,
FSDPMeshInfo(mesh, shard_mesh_dim[, replicate_mesh_dim]))`` naming a mesh of its own --
torchtitan's routed experts over ``efsdp`` while the dense parameters use ``dp``. Parameters on
the same rank grid form one *section*: one flat buffer, one all-gather, one reduce-scatter.
The backends (torch's :mod:`hyperpar.fsdp.api`, MindSpore's ``hyperpar_mindspore.fully_shard``)
call :func:`shard_placement` and :func:`mesh_key`; only the tensor mechanics are theirs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hyperpar.dtensor.mesh import DeviceMesh

__all__ = ["check_style_mesh", "divide_scale", "mesh_key", "mesh_of", "shard_placement"]


def shard_placement(fn: Callable[[Any], Any] | None, param: Any, name: str,
                    default: DeviceMesh) -> tuple[int, DeviceMesh]:
    """The dim and the data-parallel mesh ``fn`` picks for ``param`` (see the module
    docstring). Every check is local, so every rank raises alike, before any collective."""
    if fn is None:
        return 0, default
    result = fn(param)
    mesh = default
    if hasattr(result, "mesh_info") and hasattr(result, "placement"):
        mesh = mesh_of(result.mesh_info, name)
        result = result.placement
    if result is None:
        return 0, mesh
    dim = getattr(result, "dim", None)
    if type(result).__name__ != "Shard" or not isinstance(dim, int):
        raise TypeError(
            f"fully_shard: shard_placement_fn returned {result!r} for parameter {name!r}; "
            "it must return Shard(dim) (hyperpar's or torch's), None (Shard(0)) or "
            "ShardPlacementResult(placement, mesh_info)")
    return dim, mesh


def mesh_key(mesh: DeviceMesh) -> tuple[Any, ...]:
    """Meshes over the same rank grid share one section (and its collectives)."""
    key = getattr(mesh, "_hp_fsdp_key", None)
    if key is None:
        key = (tuple(mesh.mesh.reshape(-1).tolist()), tuple(mesh.shape))
        mesh._hp_fsdp_key = key
    return key


def mesh_of(info: Any, name: str) -> DeviceMesh:
    """The 1-D (shard) or 2-D (replicate, shard) dp mesh a ``FSDPMeshInfo`` describes."""
    mesh = getattr(info, "mesh", None)
    shard = getattr(info, "shard_mesh_dim", None)
    rep = getattr(info, "replicate_mesh_dim", None)
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"fully_shard: shard_placement_fn's mesh_info for parameter {name!r} has mesh "
            f"{type(mesh).__name__}; give FSDPMeshInfo(mesh=<a hyperpar DeviceMesh>, "
            "shard_mesh_dim=...) (build meshes with hyperpar's init_device_mesh)")
    if not isinstance(shard, int) or not 0 <= shard < mesh.ndim or \
            (rep is not None and (not isinstance(rep, int) or not 0 <= rep < mesh.ndim
                                  or rep == shard)):
        raise ValueError(
            f"fully_shard: mesh_info for parameter {name!r}: shard_mesh_dim={shard!r}, "
            f"replicate_mesh_dim={rep!r} are not distinct dims of the {mesh.ndim}-D mesh "
            f"{mesh!r}")
    if mesh.get_coordinate() is None:
        raise ValueError(
            f"fully_shard: the FSDP mesh {mesh!r} for parameter {name!r} does not contain "
            f"this rank; each rank must pass the mesh slice it belongs to (e.g. "
            "world_mesh['efsdp'])")
    dims = [shard] if rep is None else [rep, shard]
    if dims == list(range(mesh.ndim)):
        return mesh
    names = mesh.mesh_dim_names
    if not names:
        raise ValueError(f"fully_shard: mesh_info for parameter {name!r} picks dims {dims} "
                         f"of an unnamed mesh; name its dims or pass the 1-D slice")
    return mesh[tuple(names[d] for d in dims)] if len(dims) > 1 else mesh[names[shard]]


def divide_scale(divide_factor: float | None, shard_size: int, replicate: int = 1) -> float:
    """The factor on a section's summed gradient: ``1 / divide_factor`` when
    ``set_gradient_divide_factor`` was called (the same on every section: torchtitan divides
    the experts' and the dense gradients by the world's batch), else the mean over the
    section's own data-parallel ranks."""
    if divide_factor is not None:
        return 1.0 / divide_factor
    return 1.0 / (shard_size * replicate)


def check_style_mesh(style_mesh: DeviceMesh, dp_mesh: DeviceMesh | None, name: str) -> None:
    """Refuse to fully_shard a parameter a style already split (EP, TP) over a data-parallel
    mesh that shares ranks with the style's: this rank's style group and dp group must meet in
    this rank alone, or the two splits do not tile one grid of ranks (torch's ``fully_shard``
    refuses the same layout); ``dp_mesh`` None: the world. Local: every rank raises alike,
    before any collective."""
    mine = {int(r) for r in style_mesh.mesh.reshape(-1).tolist()}
    # None: the default data-parallel mesh, every rank of the world
    both = sorted(mine if dp_mesh is None else
                  mine & {int(r) for r in dp_mesh.mesh.reshape(-1).tolist()})
    if len(both) > 1:
        raise ValueError(
            f"fully_shard: parameter {name!r} is already split over {style_mesh!r}, which "
            f"shares ranks {both} with the data-parallel mesh {dp_mesh or 'of every rank'}: "
            f"the two layouts do not tile one grid of ranks. Shard it over the dims its style "
            f"does not use -- "
            f"for experts, torchtitan's init_device_mesh((efsdp, ep), mesh_dim_names=('efsdp', "
            f"'ep')) with ExpertParallel on mesh['ep'] and ShardPlacementResult(None, "
            f"FSDPMeshInfo(mesh['efsdp'], shard_mesh_dim=0)) from shard_placement_fn")
