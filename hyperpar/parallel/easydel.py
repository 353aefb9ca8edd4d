"""EasyDeL's tensor-parallel configuration and sharding helpers, for either framework's DTensors
(this module imports neither torch nor mindspore).

* :class:`TensorParallelConfig` -- ``(mesh, axis_name="tp", matmul_method=None,
  reduce_output=False, reduce_scatter_output=False)``, a dataclass with EasyDeL's
  ``to_dict`` / ``from_dict`` / ``to_json`` / ``from_json`` / ``replace``. The layers built from
  it are :class:`~hyperpar.parallel.ColumnParallelLinear` / :class:`RowParallelLinear`.
* "What sharding does this matmul's output get": :func:`get_sharding` (a DTensor's
  PartitionSpec-like tuple), :func:`get_matmul_output_sharding` (EasyDeL's rule on specs),
  :func:`get_output_partition_spec` and :func:`matmul_output_placements` (the answer of
  the neutral DTensor matmul rule both frameworks run, so it is what ``x @ w`` really produces).

A spec is a tuple with one entry per tensor dim: the mesh dimension name sharding it, a tuple of
names (several mesh dims), or ``None`` (not sharded) -- JAX's ``PartitionSpec`` as a tuple.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

from hyperpar.dtensor.mesh import DeviceMesh, current_mesh, init_device_mesh
from hyperpar.dtensor.placement import Placement, Shard
from hyperpar.dtensor.rules import TensorMeta, propagate
from hyperpar.dtensor.rules.matmul import matmul_labels
from hyperpar.platform import get_platform

__all__ = ["TensorParallelConfig", "get_matmul_output_sharding", "get_output_partition_spec",
           "get_sharding", "matmul_output_placements"]

Spec = tuple[Any, ...]


@dataclasses.dataclass
class TensorParallelConfig:
    """How an EasyDeL-style parallel Linear is sharded.

    * ``mesh`` -- a :class:`~hyperpar.dtensor.DeviceMesh` (``None``: the current mesh, else the
      whole world as one ``axis_name`` dimension, looked up when a layer is built);
    * ``axis_name`` -- the mesh dimension to shard over;
    * ``reduce_output`` -- the output is replicated (all-gathered / all-reduced); it wins over
      ``reduce_scatter_output``, as in EasyDeL;
    * ``reduce_scatter_output`` -- the output stays sharded on its last dim (a column layer keeps
      its feature slice, a row layer reduce-scatters its partial sums);
    * ``matmul_method`` -- EasyDeL's collective-matmul choice; only ``None`` is supported.

    The mesh is not JSON: :meth:`to_dict` stores its shape and dimension names, and
    :meth:`from_dict` takes the mesh to use (``mesh=``), else the current mesh when it has that
    shape and those names, else builds one (collective: every rank must call it).
    """

    mesh: DeviceMesh | None = None
    axis_name: str = "tp"
    matmul_method: None = None
    reduce_output: bool = False
    reduce_scatter_output: bool = False

    def __post_init__(self) -> None:
        if self.matmul_method is not None:
            raise NotImplementedError(
                f"TensorParallelConfig: matmul_method={self.matmul_method!r} (EasyDeL's "
                f"collective matmul) is not implemented; leave it None")
        if not isinstance(self.axis_name, str) or not self.axis_name:
            raise TypeError(f"TensorParallelConfig: axis_name must be a mesh dimension name, got "
                            f"{self.axis_name!r}")
        names = getattr(self.mesh, "mesh_dim_names", None)
        if self.mesh is not None and not hasattr(self.mesh, "get_mesh"):
            raise TypeError(f"TensorParallelConfig: mesh must be a hyperpar DeviceMesh "
                            f"(hyperpar.init_device_mesh), got {type(self.mesh).__name__}")
        if names and self.axis_name not in names:
            raise ValueError(f"axis_name {self.axis_name!r} not found in mesh axis names: "
                             f"{names}")

    def resolve_mesh(self) -> DeviceMesh:
        """The 1-D mesh the layers shard over."""
        mesh = self.mesh if self.mesh is not None else current_mesh()
        if mesh is None:
            mesh = init_device_mesh((get_platform().world_size(),),
                                    mesh_dim_names=(self.axis_name,))
        return mesh.get_mesh(self.axis_name)

    def replace(self, **changes: Any) -> TensorParallelConfig:
        """A copy with ``changes`` applied (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Plain data; the mesh becomes ``{"shape": [...], "dim_names": [...]}`` (or None)."""
        mesh = None
        if self.mesh is not None:
            mesh = {"shape": list(self.mesh.shape),
                    "dim_names": list(self.mesh.mesh_dim_names or ())}
        return {"mesh": mesh, "axis_name": self.axis_name, "matmul_method": self.matmul_method,
                "reduce_output": self.reduce_output,
                "reduce_scatter_output": self.reduce_scatter_output}

    @classmethod
    def from_dict(cls, data: dict[str, Any], mesh: DeviceMesh | None = None
                  ) -> TensorParallelConfig:
        """Inverse of :meth:`to_dict`; see the class docstring for how the mesh is found."""
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - fields)
        if unknown:
            raise ValueError(f"TensorParallelConfig.from_dict: unknown keys {unknown}; known: "
                             f"{sorted(fields)}")
        values = dict(data)
        stored = values.pop("mesh", None)
        if mesh is None and stored is not None:
            mesh = _find_mesh(tuple(stored["shape"]), tuple(stored.get("dim_names") or ()))
        return cls(mesh=mesh, **values)

    def to_json(self, **kwargs: Any) -> str:
        """``json.dumps(self.to_dict(), **kwargs)``."""
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_json(cls, json_str: str, mesh: DeviceMesh | None = None) -> TensorParallelConfig:
        return cls.from_dict(json.loads(json_str), mesh=mesh)


def _find_mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    mesh = current_mesh()
    if mesh is not None and tuple(mesh.shape) == shape and \
            tuple(mesh.mesh_dim_names or ()) == names:
        return mesh
    return init_device_mesh(shape, mesh_dim_names=names or None)


# ---------------------------------------------------------------------------- sharding helpers
def _spec_of(placements: Sequence[Placement], ndim: int, names: Sequence[str] | None) -> Spec:
    per_dim: list[list[str]] = [[] for _ in range(ndim)]
    for m, p in enumerate(placements):
        if isinstance(p, Shard):
            per_dim[p.dim % ndim].append(names[m] if names else str(m))
    return tuple(None if not d else d[0] if len(d) == 1 else tuple(d) for d in per_dim)


def _is_dtensor(x: Any) -> bool:
    return hasattr(x, "placements") and hasattr(x, "device_mesh")


def get_sharding(tensor: Any) -> Spec | None:
    """The spec of a DTensor (``None`` for a plain tensor). Partial placements (pending sums)
    have no spec entry, as in JAX; check ``tensor.placements`` for them."""
    if not _is_dtensor(tensor):
        return None
    return _spec_of(tensor.placements, len(tensor.shape), tensor.device_mesh.mesh_dim_names)


def get_matmul_output_sharding(lhs_pspec: Spec | None, rhs_pspec: Spec | None) -> Spec:
    """EasyDeL's rule for ``X @ W`` (``W`` laid out ``(in, out)`` as EasyDeL's kernel): the
    output keeps ``X``'s non-contracting entries and ``W``'s last one, a mesh axis used twice
    only the first time, padded with ``None`` to ``X``'s rank. ``()`` if either is ``None``."""
    if lhs_pspec is None or rhs_pspec is None:
        return ()
    used: set[str] = set()
    out: list[Any] = []
    for entry in (*tuple(lhs_pspec)[:-1], *tuple(rhs_pspec)[-1:]):
        axes = entry if isinstance(entry, tuple) else (entry,) if entry is not None else ()
        kept = tuple(a for a in axes if a not in used)
        used.update(axes)
        out.append(None if not kept else kept if isinstance(entry, tuple) else kept[0])
    out += [None] * (len(lhs_pspec) - len(out))
    return tuple(out)


def matmul_output_placements(lhs: Any, rhs: Any) -> tuple[Placement, ...]:
    """The placements ``lhs @ rhs`` gets (``torch.matmul`` semantics; ``rhs`` is ``(in, out)``)
    for two DTensors on one mesh, from the DTensor matmul rule itself: ``Shard`` where a kept
    dim is sharded, ``Partial("sum")`` where the contracted dim is, else ``Replicate``."""
    if not (_is_dtensor(lhs) and _is_dtensor(rhs)):
        raise TypeError("matmul_output_placements: both operands must be DTensors")
    metas = (TensorMeta(tuple(lhs.placements), tuple(lhs.shape)),
             TensorMeta(tuple(rhs.placements), tuple(rhs.shape)))
    return tuple(propagate("matmul", metas, tuple(lhs.device_mesh.shape)).outputs[0])


def get_output_partition_spec(lhs: Any, rhs: Any, method: Any = None,
                              axis_name: str = "tp") -> Spec | None:
    """The spec of ``lhs @ rhs`` for two DTensors (``None`` if either is a plain tensor), from
    :func:`matmul_output_placements`. ``method`` must be ``None`` and ``axis_name`` is accepted
    for EasyDeL's signature (the mesh names come from the DTensors)."""
    del axis_name
    if method is not None:
        raise NotImplementedError("get_output_partition_spec: only method=None is supported")
    if get_sharding(lhs) is None or get_sharding(rhs) is None:
        return None
    out = matmul_output_placements(lhs, rhs)
    ndim = len(matmul_labels(tuple(lhs.shape), tuple(rhs.shape))[2])
    return _spec_of(out, ndim, lhs.device_mesh.mesh_dim_names)
