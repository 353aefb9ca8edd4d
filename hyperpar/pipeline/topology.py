"""Process topologies as DeepSpeed names them: named axes laid out row-major over the ranks.

``PipelineModule(layers, topology=PipeDataParallelTopology(num_pp=2, num_dp=2))`` turns the
topology into a :class:`~hyperpar.dtensor.DeviceMesh` with the same rank layout (``"pipe"`` ->
``"pp"``, ``"data"`` -> ``"dp"``, ``"model"`` -> ``"tp"``; other axis names are kept), so the
pipeline, data-parallel and tensor-parallel groups are the mesh's.
"""

from __future__ import annotations

import itertools
from collections import namedtuple
from collections.abc import Sequence
from typing import Any

__all__ = ["PipeDataParallelTopology", "PipeModelDataParallelTopology", "ProcessTopology",
           "topology_to_mesh"]

#: DeepSpeed axis name -> hyperpar mesh dimension name
AXIS_TO_MESH_DIM = {"pipe": "pp", "data": "dp", "model": "tp"}


class ProcessTopology:
    """Ranks on an n-D grid: ``axes`` (names) of sizes ``dims``, the last axis varying fastest
    (``axes=["x", "y"]`` puts ``(x, y)`` and ``(x, y + 1)`` on consecutive ranks)."""

    def __init__(self, axes: Sequence[str], dims: Sequence[int]) -> None:
        axes, dims = list(axes), [int(d) for d in dims]
        if len(axes) != len(dims) or len(set(axes)) != len(axes) or any(d < 1 for d in dims):
            raise ValueError(f"ProcessTopology: give unique axis names and one positive size "
                             f"each, got axes={axes} dims={dims}")
        self.axes, self.dims = axes, dims
        self.ProcessCoord = namedtuple("ProcessCoord", axes)  # type: ignore[misc]
        self._coords = [self.ProcessCoord(*c)
                        for c in itertools.product(*(range(d) for d in dims))]
        self.mapping = {c: r for r, c in enumerate(self._coords)}

    def get_axis_names(self) -> list[str]:
        return list(self.axes)

    def get_dim(self, axis: str) -> int:
        """Size of ``axis`` (0 when the topology has no such axis, as in DeepSpeed)."""
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def world_size(self) -> int:
        return len(self._coords)

    def get_rank(self, **coords: int) -> int:
        """Global rank at the given coordinate (every axis named)."""
        if sorted(coords) != sorted(self.axes):
            raise ValueError(f"get_rank() needs a coordinate for each of {self.axes}, got "
                             f"{sorted(coords)}; use filter_match() for a slice")
        return self.mapping[self.ProcessCoord(**coords)]

    def get_coord(self, rank: int) -> Any:
        """The coordinate (a namedtuple with one field per axis) of ``rank``."""
        if not 0 <= rank < len(self._coords):
            raise ValueError(f"rank {rank} not found in topology of {len(self._coords)} ranks")
        return self._coords[rank]

    def filter_match(self, **criteria: int) -> list[int]:
        """Ranks whose coordinate matches every ``axis=index`` given."""
        return [r for r, c in enumerate(self._coords)
                if all(getattr(c, a) == v for a, v in criteria.items())]

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """Ranks whose coordinate along ``axis`` is ``idx``."""
        return self.filter_match(**{axis: idx})

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """One rank list per group along ``axis`` (coordinates equal on every other axis)."""
        if axis not in self.axes:
            return []
        k = self.axes.index(axis)
        groups: dict[tuple, list[int]] = {}
        for r, c in enumerate(self._coords):
            groups.setdefault(tuple(c[:k]) + tuple(c[k + 1:]), []).append(r)
        return [groups[key] for key in sorted(groups)]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(axes={self.axes}, dims={self.dims})"


class PipeDataParallelTopology(ProcessTopology):
    """``axes=["pipe", "data"]``: replicas of a stage are consecutive ranks."""

    def __init__(self, num_pp: int, num_dp: int) -> None:
        super().__init__(["pipe", "data"], [num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """``axes=["pipe", "data", "model"]``: tensor-parallel peers are consecutive ranks."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int) -> None:
        super().__init__(["pipe", "data", "model"], [num_pp, num_dp, num_mp])


def topology_to_mesh(topology: Any) -> Any:
    """The :class:`~hyperpar.dtensor.DeviceMesh` with ``topology``'s rank layout (any object
    with ``get_axis_names()`` and ``get_dim(axis)``, e.g. DeepSpeed's own ``ProcessTopology``).
    Collective: every rank calls it."""
    from hyperpar.dtensor.mesh import init_device_mesh

    if not (hasattr(topology, "get_axis_names") and hasattr(topology, "get_dim")):
        raise TypeError(f"topology= must be a ProcessTopology (get_axis_names(), get_dim()), got "
                        f"{type(topology).__name__}")
    axes = list(topology.get_axis_names())
    if "pipe" not in axes:
        raise ValueError(f"topology {axes} has no 'pipe' axis; PipelineModule needs one")
    dims = tuple(int(topology.get_dim(a)) for a in axes)
    names = tuple(AXIS_TO_MESH_DIM.get(a, a) for a in axes)
    return init_device_mesh(dims, mesh_dim_names=names)
