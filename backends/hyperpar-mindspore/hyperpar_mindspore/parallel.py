"""Tensor parallelism on MindSpore Cells with hyperpar's (and torch's) API and plan syntax.

>>> mesh = init_device_mesh((2,), mesh_dim_names=("tp",))                      # doctest: +SKIP
>>> parallelize_module(mlp, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})

What each style means -- which dim of each weight is split, what each boundary communicates
forward and backward -- comes from :mod:`hyperpar.parallel.spec`, shared with the PyTorch styles'
definition. This module supplies only MindSpore's mechanics: each rank's parameters are replaced by
its shards (``trainable_params()`` and any ``nn.Optimizer`` see the shards), boundaries are Cells
with a custom ``bprop`` (:mod:`.comm`) run from forward hooks, and a row-wise layer's bias is
swapped out of the local compute and added once after the reduction.

MindSpore has no DTensor here: outputs are always local tensors (``use_local_output=True``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mindspore import Parameter, Tensor, nn

from hyperpar.dtensor.mesh import DeviceMesh
from hyperpar.dtensor.placement import Placement, Replicate, Shard
from hyperpar.parallel.spec import (
    COLWISE,
    ROWWISE,
    Comm,
    PlanKeyError,
    StyleSpec,
    check_divisible,
)
from hyperpar.parallel.spec import resolve_plan as _resolve
from hyperpar.platform import get_platform

from .comm import Boundary, zeros
from .platform import MindSporePlatform, MSGroup

__all__ = ["ColwiseParallel", "ParallelStyle", "PlanKeyError", "RowwiseParallel",
           "UnsupportedModuleError", "check_layout", "parallelize_module", "refuse_dtensor"]


class UnsupportedModuleError(TypeError):
    """A style was applied to a Cell it cannot shard."""


# The framework's name of each parameter the spec talks about ("weight", "bias").
def _param_names(cell: nn.Cell, kind: str) -> dict[str, str]:
    if kind == "embedding" and isinstance(cell, nn.Embedding):
        return {"weight": "embedding_table"}
    if kind == "embedding":
        return {"weight": "weight"}
    return {"weight": "weight", "bias": "bias"}


class ParallelStyle:
    """A style for one Cell: :meth:`check` (before anything changes) and :meth:`apply`."""

    def check(self, cell: nn.Cell, path: str, n: int) -> None:
        """Raise, before anything changes, if the style cannot apply to ``cell`` over ``n``
        ranks (default: it always can)."""

    def apply(self, cell: nn.Cell, mesh: DeviceMesh) -> nn.Cell:
        """Apply the style to ``cell`` over ``mesh`` (1-D) in place."""
        raise NotImplementedError


def refuse_dtensor(style: str, use_local_output: bool | None) -> None:
    """Raise for ``use_local_output=False``: that asks for DTensor outputs, absent here."""
    if use_local_output is False:
        raise ValueError(f"{style}(use_local_output=False) returns a DTensor, which hyperpar's "
                         "MindSpore backend does not have yet; leave use_local_output at its "
                         "default (outputs are local tensors)")


def check_layout(what: str, layout: Any) -> Placement | None:
    """``layout`` if it is ``Shard(d)``, ``Replicate()`` or ``None``, else a ``TypeError``."""
    if layout is not None and not isinstance(layout, (Shard, Replicate)):
        raise TypeError(f"{what} must be Shard(dim) or Replicate(), got {layout!r}")
    return layout


class _ShardingStyle(ParallelStyle):
    """A style that shards a linear/embedding Cell's parameters; its meaning is ``spec``."""

    spec: StyleSpec

    def __init__(self, *, input_layouts: Placement | None = None,
                 output_layouts: Placement | None = None, use_local_output: bool = True) -> None:
        refuse_dtensor(type(self).__name__, use_local_output)
        self.input_layouts = check_layout("input_layouts", input_layouts)
        self.output_layouts = check_layout("output_layouts", output_layouts)
        self.use_local_output = use_local_output

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(input_layouts={self.input_layouts}, "
                f"output_layouts={self.output_layouts})")

    # ------------------------------------------------------------------ checks
    def _kind(self, platform: MindSporePlatform, cell: nn.Cell, path: str) -> str:
        if platform.is_linear(cell) and "linear" in self.spec.kinds():
            return "linear"
        if platform.is_embedding(cell) and "embedding" in self.spec.kinds():
            return "embedding"
        raise UnsupportedModuleError(
            f"cannot apply {type(self).__name__} to {path or '<root>'!r} "
            f"({type(cell).__module__}.{type(cell).__name__}): it shards nn.Dense, "
            f"mint.nn.Linear, nn.Embedding and mint.nn.Embedding cells; give a plan entry "
            f"for the linear/embedding cells inside it instead")

    def check(self, cell: nn.Cell, path: str, n: int) -> None:
        """Raise, before anything changes, if the style cannot shard ``cell`` over ``n`` ranks."""
        platform = get_platform()
        kind = self._kind(platform, cell, path)
        for spec_name, ms_name in _param_names(cell, kind).items():
            param = getattr(cell, ms_name, None)
            dim = self.spec.param_dims[kind].get(spec_name)
            if param is not None and dim is not None:
                check_divisible(type(self).__name__, path, ms_name, param.shape, dim, n)

    # ------------------------------------------------------------------ mechanics
    def apply(self, cell: nn.Cell, mesh: DeviceMesh) -> nn.Cell:
        """Shard ``cell``'s parameters over ``mesh`` (1-D) and install its boundary hooks."""
        platform: MindSporePlatform = get_platform()
        group = mesh.get_group(0)
        kind = self._kind(platform, cell, "")
        self._shard_params(platform, cell, kind, group)
        given = self.input_layouts
        in_comm = self.spec.input_comm(kind, given)
        out_comm = self.spec.output_comm(kind, self.output_layouts)
        if in_comm.forward != "none" or in_comm.backward != "none":
            boundary_in = Boundary(platform, in_comm, group, f"{type(self).__name__} input")

            def relayout_input(_cell: nn.Cell, args: tuple) -> tuple:
                return (boundary_in(args[0]), *args[1:])

            platform.register_forward_pre_hook(cell, relayout_input)
        boundary_out = Boundary(platform, out_comm, group, f"{type(self).__name__} output")
        self._install_local_compute(platform, cell, kind, group, boundary_out)
        return cell

    def _shard_params(self, platform: MindSporePlatform, cell: nn.Cell, kind: str,
                      group: MSGroup) -> None:
        n, me = platform.world_size(group), platform.rank(group)
        for spec_name, ms_name in _param_names(cell, kind).items():
            param = getattr(cell, ms_name, None)
            if param is None:
                continue
            # Every rank starts from rank 0's full parameter (torch's src_data_rank=0).
            full = Tensor(param.asnumpy())
            platform.broadcast(full, group.ranks[0], group)
            dim = self.spec.param_dims[kind].get(spec_name)
            data = full.asnumpy()
            if dim is not None:
                data = np.split(data, n, axis=dim)[me]
            setattr(cell, ms_name, Parameter(Tensor(np.ascontiguousarray(data)), name=param.name,
                                             requires_grad=param.requires_grad))
            if isinstance(cell, nn.Embedding) and dim == 1:
                cell.embedding_size = data.shape[1]  # nn.Embedding reshapes its output by it

    def _install_local_compute(self, platform: MindSporePlatform, cell: nn.Cell, kind: str,
                               group: MSGroup, boundary_out: Boundary) -> None:
        if boundary_out.comm.forward != "none" or boundary_out.comm.backward != "none":

            def relayout_output(_cell: nn.Cell, args: tuple, out: Any) -> Any:
                return boundary_out(out)

            platform.register_forward_hook(cell, relayout_output)


class ColwiseParallel(_ShardingStyle):
    """Split the output features of a linear (``weight`` dim 0, ``bias`` dim 0) or the embedding
    dim of an embedding (dim 1). Input replicated (its gradient all-reduced); output sharded on
    the last dim, or gathered with ``output_layouts=Replicate()``."""

    spec = COLWISE


class RowwiseParallel(_ShardingStyle):
    """Split the input features of a linear (``weight`` dim 1; the bias is added once, after the
    reduction) or the vocabulary of an embedding (dim 0; rows held elsewhere look up zeros).
    Input sharded on the last dim (linear) or replicated ids (embedding); output all-reduced
    (``Replicate()``) or reduce-scattered (``output_layouts=Shard(d)``)."""

    spec = ROWWISE

    def _install_local_compute(self, platform: MindSporePlatform, cell: nn.Cell, kind: str,
                               group: MSGroup, boundary_out: Boundary) -> None:
        if kind == "linear":
            bias = getattr(cell, "bias", None)
            if bias is None:
                return super()._install_local_compute(platform, cell, kind, group, boundary_out)
            idle = zeros(bias.shape, bias.dtype)
            # With a sharded output each rank adds the bias to its own rows only: its gradient
            # is a partial sum, all-reduced in backward (Megatron's f) to stay replicated.
            sharded_out = isinstance(self.output_layouts, Shard)
            bias_path = Boundary(platform, Comm("none", "all_reduce"), group)

            def swap_out_bias(_cell: nn.Cell, args: tuple) -> None:
                _cell._params["bias"] = idle  # the local compute adds nothing

            def reduce_then_add_bias(_cell: nn.Cell, args: tuple, out: Any) -> Any:
                _cell._params["bias"] = bias
                return boundary_out(out) + (bias_path(bias) if sharded_out else bias)

            platform.register_forward_pre_hook(cell, swap_out_bias)
            platform.register_forward_hook(cell, reduce_then_add_bias)
            return None
        # Embedding: this rank holds rows [lo, hi) of the table; other ids look up zeros.
        rows = getattr(cell, _param_names(cell, kind)["weight"]).shape[0]
        lo = platform.rank(group) * rows
        state: dict[str, Any] = {}

        def local_ids(_cell: nn.Cell, args: tuple) -> tuple:
            ids = args[0]
            mine = (ids >= lo) & (ids < lo + rows)
            state["mask"] = mine
            return ((ids - lo) * mine.astype(ids.dtype), *args[1:])

        def mask_then_reduce(_cell: nn.Cell, args: tuple, out: Any) -> Any:
            mask = state.pop("mask").astype(out.dtype).expand_dims(-1)
            return boundary_out(out * mask)

        platform.register_forward_pre_hook(cell, local_ids)
        platform.register_forward_hook(cell, mask_then_reduce)
        return None


def _children(cell: nn.Cell) -> list[tuple[str, nn.Cell]]:
    return list(cell.name_cells().items())


def parallelize_module(module: nn.Cell, device_mesh: DeviceMesh,
                       parallelize_plan: ParallelStyle | dict[str, Any], *,
                       tp_mesh_dim: str | int | None = None) -> nn.Cell:
    """Apply a style, or a plan ``{path: style}`` (``fnmatch`` wildcards per level, nested plans),
    to ``module`` in place and return it.

    On an n-D mesh the tensor-parallel dim is ``tp_mesh_dim`` (default: the dim named ``"tp"``).
    The whole plan is checked first -- a key matching nothing, a style on a cell it cannot shard,
    a dim not divisible by the tensor-parallel degree -- so a bad plan changes nothing.
    """
    mesh = _tp_mesh(device_mesh, tp_mesh_dim)
    entries = _resolve(module, parallelize_plan, children=_children,
                       is_style=lambda s: isinstance(s, ParallelStyle))
    n = mesh.size()
    for path, cell, style in entries:
        style.check(cell, path, n)
    for _path, cell, style in entries:
        style.apply(cell, mesh)
    return module


def _tp_mesh(mesh: DeviceMesh, dim: str | int | None) -> DeviceMesh:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"parallelize_module needs a hyperpar_mindspore DeviceMesh (from "
                        f"init_device_mesh), got {type(mesh).__name__}")
    if mesh.ndim == 1 and dim is None:
        return mesh
    if dim is None:
        if not mesh.mesh_dim_names or "tp" not in mesh.mesh_dim_names:
            raise ValueError(f"{mesh} has {mesh.ndim} dims and none is named 'tp'; pass "
                             "tp_mesh_dim= or name a dim 'tp'")
        dim = "tp"
    if isinstance(dim, int):
        dim = mesh.mesh_dim_names[dim] if mesh.mesh_dim_names else dim
    if isinstance(dim, int):
        return mesh.get_mesh(dim)
    return mesh[dim]
