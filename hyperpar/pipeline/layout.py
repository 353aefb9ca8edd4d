"""Where a pipeline's stages sit: the pipeline group, its ranks, this rank's stages and the
data-parallel group of its replicas. Framework-neutral: both frameworks' ``PipelineModule``
resolve ``num_stages`` / ``group`` / ``mesh`` / ``topology`` through :func:`resolve_stages`.

Three ways to say it, as in DeepSpeed and torch:

* ``mesh=`` (and ``mesh_dim=``, default ``"pp"``): the pipeline runs along that dimension; on an
  n-D mesh with a ``"dp"`` dimension its groups are the data-parallel replicas;
* ``topology=PipeDataParallelTopology(num_pp, num_dp)``: becomes such a mesh
  (:func:`~hyperpar.pipeline.topology.topology_to_mesh`);
* ``num_stages`` smaller than the world: ``world // num_stages`` pipelines of consecutive stages
  (pipeline ``d`` is global ranks ``d, d + dp, d + 2*dp, ...``), DeepSpeed's layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hyperpar.dtensor.mesh import ensure_world
from hyperpar.platform import get_platform

__all__ = ["StageLayout", "check_layout_arguments", "resolve_stages"]


@dataclass
class StageLayout:
    """The result of :func:`resolve_stages` (every field as ``PipelineModule`` exposes it).

    ``group``: the pipeline's platform group (``None``: the world, or one stage);
    ``stage_ranks[i]``: global rank of pipeline rank ``i``; ``stage_id``: this rank's index in
    it; ``local_stages``: the stages this rank runs (``virtual_stages`` of them, round-robin);
    ``dp_group`` / ``dp_size``: the replicas of this rank's stages; ``mesh``: the mesh given
    (or made from the topology), else ``None``."""

    group: Any
    stage_ranks: list[int]
    stage_id: int
    num_stages: int
    virtual_stages: int
    local_stages: list[int]
    dp_group: Any
    dp_size: int
    mesh: Any = None

    @property
    def total_stages(self) -> int:
        return self.num_stages * self.virtual_stages

    def apply_to(self, module: Any) -> None:
        """Set every field (and ``total_stages``) as an attribute of ``module``: both
        frameworks' ``PipelineModule`` expose the layout this way."""
        for name in self.__dataclass_fields__:
            setattr(module, name, getattr(self, name))
        module.total_stages = self.total_stages


def check_layout_arguments(num_stages: int | None, topology: Any, group: Any, mesh: Any,
                           virtual_stages: int) -> None:
    """The checks needing no peer, raised alike on every rank before any collective."""
    given = [name for name, v in (("topology", topology), ("mesh", mesh), ("group", group))
             if v is not None]
    if len(given) > 1:
        raise ValueError(f"PipelineModule: pass only one of topology=, mesh=, group=; got "
                         f"{' and '.join(given)}")
    if topology is not None and num_stages is not None and hasattr(topology, "get_dim") \
            and topology.get_dim("pipe") != num_stages:
        raise ValueError(f"PipelineModule: num_stages={num_stages} but the topology's 'pipe' "
                         f"axis has {topology.get_dim('pipe')}; give one of them")
    if mesh is not None and not hasattr(mesh, "get_mesh"):
        raise TypeError(f"PipelineModule: mesh= must be a hyperpar DeviceMesh "
                        f"(hyperpar.init_device_mesh), got {type(mesh).__name__}")
    if not isinstance(virtual_stages, int) or virtual_stages < 1:
        raise ValueError(f"PipelineModule: virtual_stages must be an int >= 1, got "
                         f"{virtual_stages!r}")


def resolve_stages(num_stages: int | None = None, *, group: Any = None, mesh: Any = None,
                   mesh_dim: str | int | None = None, topology: Any = None,
                   virtual_stages: int = 1) -> StageLayout:
    """This rank's :class:`StageLayout`. Collective over the world when it creates groups
    (a topology's mesh, DeepSpeed's split of the world); every check that can fail runs first,
    on every rank alike."""
    check_layout_arguments(num_stages, topology, group, mesh, virtual_stages)
    if topology is not None:
        from .topology import topology_to_mesh

        mesh, mesh_dim = topology_to_mesh(topology), "pp"
        num_stages = topology.get_dim("pipe")
    platform = get_platform()
    if group is None and mesh is None:
        # No group given: the world, joined by the rule init_device_mesh follows (from the
        # launcher's environment; a lone process is a world of one) -- never a silently
        # assumed 1-rank world under a launcher.
        ensure_world(platform)
    dp_group: Any = None
    has_dp = False
    if mesh is not None:
        group = mesh.get_mesh(mesh_dim, default="pp").get_group()   # raises: no such dim
        names = mesh.mesh_dim_names or ()
        if mesh.ndim > 1 and "dp" in names and mesh_dim not in ("dp", names.index("dp")):
            dp_group, has_dp = mesh.get_mesh("dp").get_group(), True
    distributed = platform.is_initialized()
    group_size = platform.world_size(group) if distributed else 1
    group_ranks = platform.group_ranks(group) if distributed else [0]
    num_stages = group_size if num_stages is None else num_stages
    if not isinstance(num_stages, int) or isinstance(num_stages, bool) or num_stages < 1:
        raise ValueError(f"PipelineModule: num_stages must be a positive int, got "
                         f"{num_stages!r}")
    if group_size % num_stages:
        raise ValueError(f"PipelineModule: num_stages={num_stages} does not divide the group "
                         f"size {group_size}; use a divisor of {group_size} (e.g. "
                         f"{group_size})")
    if group is not None and num_stages not in (1, group_size) \
            and group_size != platform.world_size():
        raise ValueError(
            f"PipelineModule: num_stages={num_stages} is smaller than the group "
            f"({group_size} ranks); splitting into several pipelines is supported only for the "
            f"world group. Pass a group of exactly {num_stages} ranks instead.")
    me = platform.rank() if distributed else 0
    if num_stages == 1:
        pp_group, stage_ranks = None, [me]
        if group_size > 1 and mesh is None:   # every rank holds the whole model: replicas
            dp_group, has_dp = group, True
    elif num_stages == group_size:
        pp_group, stage_ranks = group, group_ranks
    else:
        pp_group, stage_ranks, dp_group = _split_world(num_stages, group_size, group_ranks, me)
        has_dp = True
    if me not in stage_ranks:
        raise ValueError(f"PipelineModule: rank {me} is not in the pipeline group (global "
                         f"ranks {stage_ranks}); build the module on its members only")
    stage_id = stage_ranks.index(me)
    return StageLayout(
        group=pp_group, stage_ranks=list(stage_ranks), stage_id=stage_id,
        num_stages=num_stages, virtual_stages=virtual_stages,
        local_stages=[stage_id + k * num_stages for k in range(virtual_stages)],
        dp_group=dp_group, dp_size=platform.world_size(dp_group) if has_dp else 1, mesh=mesh)


def _split_world(num_stages: int, group_size: int, group_ranks: list[int], me: int
                 ) -> tuple[Any, list[int], Any]:
    """``group_size // num_stages`` pipelines of consecutive stages, DeepSpeed's layout; the
    ranks holding the same stage are a data-parallel group. Collective: every rank creates
    every group in the same order (a platform creating only its members' skips the others)."""
    platform = get_platform()
    dp = group_size // num_stages
    pp_group, stage_ranks, dp_group = None, [], None
    for d in range(dp):
        ranks = [group_ranks[s * dp + d] for s in range(num_stages)]
        handle = platform.new_group(ranks)
        if me in ranks:
            pp_group, stage_ranks = handle, ranks
    for s in range(num_stages):
        ranks = [group_ranks[s * dp + d] for d in range(dp)]
        handle = platform.new_group(ranks)
        if me in ranks:
            dp_group = handle
    return pp_group, stage_ranks, dp_group
