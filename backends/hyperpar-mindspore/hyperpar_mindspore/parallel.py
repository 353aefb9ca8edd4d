"""Tensor parallelism on MindSpore Cells with hyperpar's (and torch's) API and plan syntax.

>>> mesh = init_device_mesh((2,), mesh_dim_names=("tp",))                      # doctest: +SKIP
>>> parallelize_module(mlp, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})

``parallelize_module`` is hyperpar's one driver (:mod:`hyperpar.parallel.driver`: plan
resolution, checks, tied parameters, ``src_data_rank``); the styles here implement its style
protocol. What each style means -- which dim of each weight is split, what each boundary
communicates forward and backward -- comes from :mod:`hyperpar.parallel.spec`, shared with the
PyTorch styles. This module supplies only MindSpore's mechanics: each rank's parameters are
replaced by its ``torch.chunk`` pieces (``trainable_params()`` and any ``nn.Optimizer`` see the
shards), boundaries are Cells with a custom ``bprop`` (:mod:`.comm`) run from forward hooks, and
a row-wise layer's bias is swapped out of the local compute and added once after the reduction.

Outputs are local tensors by default; ``use_local_output=False`` makes them MindSpore DTensors
(:mod:`.dtensor`) laid out as the style's output layout, and a DTensor input is redistributed to
the layout the style wants.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mindspore import Parameter, Tensor, nn

from hyperpar.dtensor.mesh import DeviceMesh
from hyperpar.dtensor.placement import Partial, Placement, Replicate, Shard, chunk_bounds
from hyperpar.parallel.driver import (
    AlreadyParallelizedError,
    PlanKeyError,
    StyleBase,
    TiedParameterError,
    UnsupportedModuleError,
    parallelize_module,
)
from hyperpar.parallel.spec import COLWISE, ROWWISE, Comm, StyleSpec
from hyperpar.platform import get_platform

from .comm import Boundary, check_no_empty_piece, lengths_along, zeros
from .dtensor import DTensor
from .graph import graph_boundary, install_graph_hooks, refuse_graph_mode
from .platform import SHARD_PLACEMENTS, MindSporePlatform, MSGroup

__all__ = ["AlreadyParallelizedError", "ColwiseParallel", "ParallelStyle", "PlanKeyError",
           "RowwiseParallel", "TiedParameterError", "UnsupportedModuleError", "as_local",
           "check_layout", "parallelize_module", "wrap_output"]


# The framework's name of each parameter the spec talks about ("weight", "bias").
def _param_names(cell: nn.Cell, kind: str) -> dict[str, str]:
    if kind == "embedding" and isinstance(cell, nn.Embedding):
        return {"weight": "embedding_table"}
    if kind == "embedding":
        return {"weight": "weight"}
    return {"weight": "weight", "bias": "bias"}


class ParallelStyle(StyleBase):
    """A style for one Cell, driven by :func:`parallelize_module` through the style protocol
    (:class:`~hyperpar.parallel.driver.StyleBase`); a style implements ``_apply``."""

    def _apply(self, cell: nn.Cell, device_mesh: DeviceMesh) -> nn.Cell:
        """Apply the style to ``cell`` over ``device_mesh`` (1-D) in place. A subclass
        overrides this (torch's spelling) or :meth:`apply` (HyperParallel's)."""
        if type(self).apply is not ParallelStyle.apply:
            return type(self).apply(self, cell, device_mesh)
        raise NotImplementedError(f"{type(self).__name__} overrides neither _apply nor apply")

    def apply(self, cell: nn.Cell, device_mesh: DeviceMesh) -> nn.Cell:
        """Public spelling of ``_apply`` (refuses an already-parallelized Cell)."""
        self._check_applicable(cell, "")
        self._apply(cell, device_mesh)
        self._mark_applied(cell)
        return cell


def check_layout(what: str, layout: Any) -> Placement | None:
    """``layout`` if it is ``Shard(d)``, ``Replicate()``, ``Partial()`` or ``None``, else a
    ``TypeError``."""
    if layout is not None and not isinstance(layout, (Shard, Replicate, Partial)):
        raise TypeError(f"{what} must be Shard(dim), Replicate() or Partial(), got {layout!r}")
    return layout


def as_local(x: Any, layout: Placement, what: str = "") -> Any:
    """A DTensor input redistributed (differentiably) to ``layout`` and unwrapped; a plain
    tensor is taken to be laid out as ``layout`` already (torch's rule for local inputs)."""
    if not isinstance(x, DTensor):
        return x
    if len(x.placements) != 1:
        raise ValueError(f"{what}: expected a DTensor on a 1-D mesh, got placements "
                         f"{x.placements}; pass the tensor-parallel slice")
    return x.redistribute(x.device_mesh, (layout,)).to_local()


def wrap_output(y: Any, mesh: DeviceMesh, placement: Placement, length: int | None = None,
                what: str = "") -> Any:
    """``y``, this rank's piece, as a DTensor laid out as ``placement``. ``length``: the global
    length along a ``Shard`` dim when known (else the ranks exchange theirs)."""
    shape = list(y.shape)
    if isinstance(placement, Shard):
        d = placement.dim % y.ndim
        shape[d] = length if length is not None else sum(
            lengths_along(get_platform(), y, d, mesh.get_group(0), what))
    return DTensor.from_local(y, mesh, (placement,), shape=tuple(shape))


#: attribute of a shard Parameter: the group it is split over (``SHARD_PLACEMENTS`` says how)
SHARD_GROUP = "_hyperpar_group"


def shard_parameter(platform: MindSporePlatform, cell: nn.Cell, name: str, dim: int | None,
                    group: MSGroup, src_data_rank: int | None) -> Parameter | None:
    """Replace ``cell.<name>`` by this rank's ``torch.chunk`` piece along ``dim`` (``None``:
    whole) of rank ``src_data_rank``'s full parameter (an index in ``group``; ``None``: this
    rank's own), recording its placements. Returns the new Parameter."""
    param = cell._params.get(name)
    if param is None:
        return None
    n, me = platform.world_size(group), platform.rank(group)
    if dim is not None:
        check_no_empty_piece(param.shape[dim], n, dim, tuple(param.shape),
                             f"{param.name} ({name})")
    full = Tensor(param.asnumpy())
    if src_data_rank is not None:
        platform.broadcast(full, group.ranks[src_data_rank], group)
    data = full.asnumpy()
    if dim is not None:
        start, length = chunk_bounds(data.shape[dim], n, me)
        data = np.take(data, np.arange(start, start + length), axis=dim)
    new = Parameter(Tensor(np.ascontiguousarray(data)), name=param.name,
                    requires_grad=param.requires_grad)
    setattr(new, SHARD_PLACEMENTS, (Replicate(),) if dim is None else (Shard(dim),))
    setattr(new, SHARD_GROUP, group)  # checkpoints place the shard in the global tensor
    cell._params[name] = new
    return new


def check_src_data_rank(style: str, src_data_rank: int | None, n: int) -> None:
    """Raise (on every rank, before any broadcast) for a source rank outside the group."""
    if src_data_rank is not None and not 0 <= src_data_rank < n:
        raise ValueError(f"{style}: src_data_rank={src_data_rank} is not a rank of the "
                         f"{n}-rank tensor-parallel group; give 0..{n - 1}, or None for each "
                         f"rank to keep its own parameters")


class _ShardingStyle(ParallelStyle):
    """A style that shards a linear/embedding Cell's parameters; its meaning is ``spec``."""

    spec: StyleSpec
    _claims = ("parameters",)

    def __init__(self, *, input_layouts: Placement | None = None,
                 output_layouts: Placement | None = None, use_local_output: bool = True) -> None:
        self.input_layouts = check_layout("input_layouts", input_layouts)
        self.output_layouts = check_layout("output_layouts", output_layouts)
        for what, given in (("input", self.input_layouts), ("output", self.output_layouts)):
            try:  # a layout no boundary reaches is refused now, not when the plan is applied
                for kind in self.spec.kinds():
                    comm = self.spec.input_comm if what == "input" else self.spec.output_comm
                    comm(kind, given)
            except ValueError as exc:
                raise ValueError(f"{type(self).__name__}({what}_layouts={given!r}): {exc}") \
                    from None
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

    def _check_applicable(self, cell: nn.Cell, fqn: str,
                          pending: dict[str, str] | None = None) -> None:
        """Raise, before anything changes, if ``cell`` is parallelized already or is not a
        linear/embedding Cell."""
        super()._check_applicable(cell, fqn, pending)
        self._kind(get_platform(), cell, fqn)
        if getattr(cell, "_recompute_cell", None) is not None:
            # MindSpore's recompute() captures the Cell's parameters when called: the shards
            # would then get the gradients of the replaced full parameters (measured: silently
            # wrong losses from the second step on).
            raise ValueError(
                f"{fqn or 'the root Cell'!r} ({type(cell).__name__}) was set to recompute() "
                f"before parallelize_module; call recompute() after parallelize_module")

    def _param_placements(self, cell: nn.Cell, owner: nn.Cell, name: str) -> Any:
        if owner is not cell:
            return None
        kind = self._kind(get_platform(), cell, "")
        for spec_name, ms_name in _param_names(cell, kind).items():
            if ms_name == name:
                dim = self.spec.param_dims[kind].get(spec_name)
                return (Replicate(),) if dim is None else (Shard(dim),)
        return None

    # ------------------------------------------------------------------ mechanics
    def _apply(self, cell: nn.Cell, device_mesh: DeviceMesh) -> nn.Cell:
        """Shard ``cell``'s parameters over ``device_mesh`` (1-D) and install its boundary
        hooks."""
        platform: MindSporePlatform = get_platform()
        group = device_mesh.get_group(0)
        kind = self._kind(platform, cell, "")
        check_src_data_rank(type(self).__name__, self.src_data_rank, platform.world_size(group))
        shape = self._shard_params(platform, cell, kind, group)
        out_full = shape[0] if kind == "linear" else shape[1]
        in_comm = self.spec.input_comm(kind, self.input_layouts)
        out_comm = self.spec.output_comm(kind, self.output_layouts)
        name = type(self).__name__
        src = self.input_layouts or self.spec.default_input
        boundary_in = None
        if in_comm.forward != "none" or in_comm.backward != "none":
            boundary_in = Boundary(platform, in_comm, group, f"{name} input")

        def relayout_input(_cell: nn.Cell, args: tuple) -> tuple:
            x = as_local(args[0], src, f"{name} input")  # a DTensor: to the layout wanted
            return (x if boundary_in is None else boundary_in(x), *args[1:])

        handles = [platform.register_forward_pre_hook(cell, relayout_input)]
        # a column-parallel output is gathered knowing the weight's global size
        full = out_full if out_comm.forward == "all_gather" else None
        boundary_out = Boundary(platform, out_comm, group, f"{name} output", full)
        dst = self.output_layouts or self.spec.default_output
        use_local = self.use_local_output

        def finish(pre: Any, post: Any) -> Any:
            """The output: ``post`` (after the boundary) as it is, or as a DTensor laid out as
            ``dst``; ``pre`` is the local compute's output, before the boundary."""
            if use_local:
                return post
            length = None
            if isinstance(dst, Shard):
                d = dst.dim % post.ndim
                if out_comm.forward == "reduce_scatter":
                    length = int(pre.shape[d])
                elif out_comm.forward == "none" and d == post.ndim - 1:
                    length = out_full  # column-parallel: the weight says it
            return wrap_output(post, device_mesh, dst, length, f"{name} output")

        handles += self._install_local_compute(platform, cell, kind, group, boundary_out, shape,
                                               finish)
        self._install_graph(platform, cell, kind, group, in_comm, out_comm, shape, handles)
        return cell

    def _install_graph(self, platform: MindSporePlatform, cell: nn.Cell, kind: str,
                       group: MSGroup, in_comm: Comm, out_comm: Comm, shape: tuple[int, ...],
                       handles: list[Any]) -> None:
        """The graph-mode (``ms.jit`` / ``GRAPH_MODE``) boundaries of ``cell`` (:mod:`.graph`),
        or a refusal that names the reason when the graph path does not cover this use."""
        what = f"{type(self).__name__} on {type(cell).__name__}"
        n, rank = platform.world_size(group), platform.rank(group)
        try:
            if not self.use_local_output:
                raise ValueError("use_local_output=False (DTensor outputs) runs in PyNative "
                                 "mode only")
            pre = post = None
            if in_comm.forward != "none" or in_comm.backward != "none":
                in_size = shape[1] if kind == "linear" else None
                pre = graph_boundary(in_comm, group.name, n, rank, in_size)
            if out_comm.forward != "none" or out_comm.backward != "none":
                out_size = shape[0] if kind == "linear" else shape[1]
                post = graph_boundary(out_comm, group.name, n, rank, out_size)
            bias, share = self._graph_bias(platform, cell, kind, group)
        except ValueError as exc:
            refuse_graph_mode(cell, what, str(exc))
            return
        install_graph_hooks(cell, handles, pre, post, bias, share)

    def _graph_bias(self, platform: MindSporePlatform, cell: nn.Cell, kind: str,
                    group: MSGroup) -> tuple[Any, float]:
        """A row-wise linear's bias path in graph mode (``None``: the bias stays in the Cell's
        own compute)."""
        return None, 1.0

    def _shard_params(self, platform: MindSporePlatform, cell: nn.Cell, kind: str,
                      group: MSGroup) -> tuple[int, ...]:
        """Shard the parameters; return the weight's global shape."""
        shape: tuple[int, ...] = ()
        for spec_name, ms_name in _param_names(cell, kind).items():
            param = cell._params.get(ms_name)
            if param is None:
                continue
            if spec_name == "weight":
                shape = tuple(param.shape)
            dim = self.spec.param_dims[kind].get(spec_name)
            new = shard_parameter(platform, cell, ms_name, dim, group, self.src_data_rank)
            if isinstance(cell, nn.Embedding) and dim == 1:
                cell.embedding_size = new.shape[1]  # nn.Embedding reshapes its output by it
        return shape

    def _install_local_compute(self, platform: MindSporePlatform, cell: nn.Cell, kind: str,
                               group: MSGroup, boundary_out: Boundary,
                               shape: tuple[int, ...], finish: Any) -> list[Any]:
        """Install the output side's PyNative hooks; return their handles."""
        if boundary_out.comm.forward != "none" or boundary_out.comm.backward != "none" or (
                not self.use_local_output):

            def relayout_output(_cell: nn.Cell, args: tuple, out: Any) -> Any:
                return finish(out, boundary_out(out))

            return [platform.register_forward_hook(cell, relayout_output)]
        return []


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

    def _check_applicable(self, cell: nn.Cell, fqn: str,
                          pending: dict[str, str] | None = None) -> None:
        super()._check_applicable(cell, fqn, pending)
        if getattr(cell, "activation_flag", False):
            # nn.Dense applies its activation inside construct, to this rank's partial sum:
            # the reduction after it would add up activations of partial sums (silently wrong)
            raise ValueError(
                f"RowwiseParallel cannot shard {fqn or 'the root Cell'!r} "
                f"({type(cell).__name__} with activation {type(cell.activation).__name__}): "
                f"the activation would act on each rank's partial sum before the reduction; "
                f"build the Dense without activation= and apply the activation after it")

    def _graph_bias(self, platform: MindSporePlatform, cell: nn.Cell, kind: str,
                    group: MSGroup) -> tuple[Any, float]:
        if kind == "embedding":
            raise ValueError("a row-wise embedding masks the ids held elsewhere between its two "
                             "hooks, which runs in PyNative mode only")
        if cell._params.get("bias") is None:
            return None, 1.0
        n, rank = platform.world_size(group), platform.rank(group)
        # as in PyNative: a sharded output's bias gets its gradient all-reduced, a Partial
        # output's bias is added by rank 0 alone
        grad = "all_reduce" if isinstance(self.output_layouts, (Shard, Partial)) else "none"
        share = 1.0 if rank == 0 or not isinstance(self.output_layouts, Partial) else 0.0
        return graph_boundary(Comm("none", grad), group.name, n, rank), share

    def _install_local_compute(self, platform: MindSporePlatform, cell: nn.Cell, kind: str,
                               group: MSGroup, boundary_out: Boundary,
                               shape: tuple[int, ...], finish: Any) -> list[Any]:
        if kind == "linear":
            bias = cell._params.get("bias")
            if bias is None:
                return super()._install_local_compute(platform, cell, kind, group, boundary_out,
                                                      shape, finish)
            idle = zeros(bias.shape, bias.dtype)
            # With a sharded output each rank adds the bias to its own rows only: its gradient
            # is a partial sum, all-reduced in backward (Megatron's f) to stay replicated.
            sharded_out = isinstance(self.output_layouts, Shard)
            # A Partial output is a sum over ranks: rank 0 alone adds the bias (its gradient,
            # rank 0's, is all-reduced so every rank steps the same).
            partial_out = isinstance(self.output_layouts, Partial)
            bias_share = 1.0 if platform.rank(group) == 0 else 0.0
            bias_path = Boundary(platform, Comm("none", "all_reduce"), group)

            saved: list[Any] = []

            def swap_out_bias(_cell: nn.Cell, args: tuple) -> None:
                saved.append(_cell._params["bias"])  # the one there now (a tie may replace it)
                _cell._params["bias"] = idle  # the local compute adds nothing

            def reduce_then_add_bias(_cell: nn.Cell, args: tuple, out: Any) -> Any:
                bias = saved.pop()
                _cell._params["bias"] = bias
                if partial_out:
                    return finish(out, boundary_out(out) + bias_path(bias) * bias_share)
                return finish(out, boundary_out(out) + (bias_path(bias) if sharded_out else bias))

            return [platform.register_forward_pre_hook(cell, swap_out_bias),
                    platform.register_forward_hook(cell, reduce_then_add_bias)]
        # Embedding: this rank holds rows [lo, hi) of the table; other ids look up zeros.
        lo, rows = chunk_bounds(shape[0], platform.world_size(group), platform.rank(group))
        state: dict[str, Any] = {}

        def local_ids(_cell: nn.Cell, args: tuple) -> tuple:
            ids = args[0]
            mine = (ids >= lo) & (ids < lo + rows)
            state["mask"] = mine
            return ((ids - lo) * mine.astype(ids.dtype), *args[1:])

        def mask_then_reduce(_cell: nn.Cell, args: tuple, out: Any) -> Any:
            mask = state.pop("mask").astype(out.dtype).expand_dims(-1)
            masked = out * mask
            return finish(masked, boundary_out(masked))

        return [platform.register_forward_pre_hook(cell, local_ids),
                platform.register_forward_hook(cell, mask_then_reduce)]
