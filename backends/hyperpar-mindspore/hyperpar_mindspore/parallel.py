"""MindSpore's mechanics of the parallel styles: what ``ColwiseParallel`` and
``RowwiseParallel`` do to a Cell.

The styles are hyperpar's one set (:mod:`hyperpar.parallel.styles`: arguments, checks, which
parameter gets which placement), the same classes as on PyTorch; ``parallelize_module`` is the
one driver (:mod:`hyperpar.parallel.driver`). What each style means -- which dim of each weight
is split, what each boundary communicates forward and backward -- is
:mod:`hyperpar.parallel.spec`. This module supplies only MindSpore's mechanics: each rank's
parameters are replaced by its ``torch.chunk`` pieces (``trainable_params()`` and any
``nn.Optimizer`` see the shards), boundaries are Cells with a custom ``bprop`` (:mod:`.comm`)
run from forward hooks, and a row-wise layer's bias is swapped out of the local compute and
added once after the reduction.

Outputs are local tensors by default; ``use_local_output=False`` makes them MindSpore DTensors
(:mod:`.dtensor`) laid out as the style's output layout, and a DTensor input is redistributed to
the layout the style wants.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mindspore import Parameter, Tensor, nn

from hyperpar.dtensor.mesh import DeviceMesh
from hyperpar.dtensor.placement import Placement, Replicate, Shard, chunk_bounds
from hyperpar.parallel.driver import (
    AlreadyParallelizedError,
    PlanKeyError,
    TiedParameterError,
    UnsupportedModuleError,
    parallelize_module,
)
from hyperpar.parallel.spec import (
    ROWWISE,
    Comm,
    boundary_global_shape,
    check_style_input,
    feature_lengths,
    local_range,
    output_global_shape,
    row_bias,
)
from hyperpar.parallel.styles import ColwiseParallel, ParallelStyle, RowwiseParallel
from hyperpar.platform import get_platform
from hyperpar.platform.base import Platform

from .collectives import MSGroup
from .comm import Boundary, lengths_along, zeros
from .dtensor import DTensor
from .graph import graph_boundary, install_graph_hooks, refuse_graph_mode
from .param_readback import attach_full_tensor
from .tensors import SHARD_PLACEMENTS

__all__ = ["AlreadyParallelizedError", "ColwiseParallel", "ParallelStyle", "PlanKeyError",
           "RowwiseParallel", "TiedParameterError", "UnsupportedModuleError", "as_local",
           "check_sharding_style", "parallelize_module", "wrap_output"]


# The framework's name of each parameter the spec talks about ("weight", "bias").
def param_names(cell: nn.Cell, kind: str) -> dict[str, str]:
    if kind == "embedding" and isinstance(cell, nn.Embedding):
        return {"weight": "embedding_table"}
    if kind == "embedding":
        return {"weight": "weight"}
    return {"weight": "weight", "bias": "bias"}


def as_local(x: Any, layout: Placement, what: str = "") -> Any:
    """A DTensor input redistributed (differentiably) to ``layout`` and unwrapped; a plain
    tensor is taken to be laid out as ``layout`` already (torch's rule for local inputs)."""
    if not isinstance(x, DTensor):
        return x
    check_style_input(x.placements, what)
    return x.redistribute(x.device_mesh, (layout,)).to_local()


def wrap_output(y: Any, mesh: DeviceMesh, placement: Placement, length: int | None = None,
                what: str = "") -> Any:
    """``y``, this rank's piece, as a DTensor laid out as ``placement``. ``length``: the global
    length along a ``Shard`` dim when known (else the ranks exchange theirs)."""
    shape = boundary_global_shape(y.shape, placement, length, lambda d: sum(
        lengths_along(get_platform(), y, d, mesh.get_group(0), what)))
    return DTensor.from_local(y, mesh, (placement,), shape=shape)


#: attribute of a shard Parameter: the group it is split over (``SHARD_PLACEMENTS`` says how)
SHARD_GROUP = "_hyperpar_group"


def shard_parameter(platform: Platform, cell: nn.Cell, name: str, dim: int | None,
                    group: MSGroup, src_data_rank: int | None) -> Parameter | None:
    """Replace ``cell.<name>`` by this rank's ``torch.chunk`` piece along ``dim`` (``None``:
    whole) of rank ``src_data_rank``'s full parameter (an index in ``group``; ``None``: this
    rank's own), recording its placements. Returns the new Parameter."""
    param = cell._params.get(name)
    if param is None:
        return None
    n, me = platform.world_size(group), platform.rank(group)
    # an empty piece was refused before the plan changed anything (the style's _check_mesh)
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
    new._hyperpar_full_shape = tuple(param.shape)
    cell._params[name] = new
    return new


# --------------------------------------------------------------------------- checks
def check_sharding_style(style: Any, cell: nn.Cell, fqn: str) -> None:
    """Before a plan changes anything, after the neutral checks (a linear/embedding module, a
    source rank of the group): ``cell`` is one MindSpore can shard with ``style`` (not set to
    ``recompute()``; for ``RowwiseParallel``, no activation inside the Dense)."""
    if getattr(cell, "_recompute_cell", None) is not None:
        # MindSpore's recompute() captures the Cell's parameters when called: the shards
        # would then get the gradients of the replaced full parameters (measured: silently
        # wrong losses from the second step on).
        raise ValueError(
            f"{fqn or 'the root Cell'!r} ({type(cell).__name__}) was set to recompute() "
            f"before parallelize_module; call recompute() after parallelize_module")
    if style.spec is ROWWISE and getattr(cell, "activation_flag", False):
        # nn.Dense applies its activation inside construct, to this rank's partial sum:
        # the reduction after it would add up activations of partial sums (silently wrong)
        raise ValueError(
            f"RowwiseParallel cannot shard {fqn or 'the root Cell'!r} "
            f"({type(cell).__name__} with activation {type(cell.activation).__name__}): "
            f"the activation would act on each rank's partial sum before the reduction; "
            f"build the Dense without activation= and apply the activation after it")


# --------------------------------------------------------------------------- mechanics
def _shard(style: Any, cell: nn.Cell, device_mesh: DeviceMesh, kind: str) -> nn.Cell:
    """Shard ``cell``'s parameters over ``device_mesh`` (1-D) and install its boundary
    hooks."""
    platform: Platform = get_platform()
    group = device_mesh.get_group(0)
    shape = _shard_params(style, platform, cell, kind, group)
    for ms_name in param_names(cell, kind).values():  # torch's p.full_tensor() read-back
        param = cell._params.get(ms_name)
        if param is not None:
            attach_full_tensor(param, device_mesh, getattr(param, SHARD_PLACEMENTS),
                               param._hyperpar_full_shape)
    in_comm = style.spec.input_comm(kind, style.input_layouts[0])
    out_comm = style.spec.output_comm(kind, style.output_layouts[0])
    name = type(style).__name__
    src = style.input_layouts[0]
    boundary_in = None
    if in_comm.forward != "none" or in_comm.backward != "none":
        boundary_in = Boundary(platform, in_comm, group, f"{name} input")

    def relayout_input(_cell: nn.Cell, args: tuple) -> tuple:
        x = as_local(args[0], src, f"{name} input")  # a DTensor: to the layout wanted
        return (x if boundary_in is None else boundary_in(x), *args[1:])

    handles = [platform.register_forward_pre_hook(cell, relayout_input)]
    # a column-parallel output is gathered knowing the weight's global size
    full = feature_lengths(kind, shape)[1] if out_comm.forward == "all_gather" else None
    boundary_out = Boundary(platform, out_comm, group, f"{name} output", full)
    dst = style.output_layouts[0]
    use_local = style.use_local_output

    def finish(pre: Any, post: Any) -> Any:
        """The output: ``post`` (after the boundary) as it is, or as a DTensor laid out as
        ``dst``; ``pre`` is the local compute's output, before the boundary."""
        if use_local:
            return post
        length = None
        if isinstance(dst, Shard):  # the global shape is known: no exchange of lengths
            whole = output_global_shape(style.spec, kind, tuple(pre.shape), shape)
            length = whole[dst.dim % post.ndim]
        return wrap_output(post, device_mesh, dst, length, f"{name} output")

    handles += _install_local_compute(style, platform, cell, kind, group, boundary_out, shape,
                                           finish)
    _install_graph(style, platform, cell, kind, group, in_comm, out_comm, shape, handles)
    return cell


def _install_graph(style: Any, platform: Platform, cell: nn.Cell, kind: str,
                   group: MSGroup, in_comm: Comm, out_comm: Comm, shape: tuple[int, ...],
                   handles: list[Any]) -> None:
    """The graph-mode (``ms.jit`` / ``GRAPH_MODE``) boundaries of ``cell`` (:mod:`.graph`),
    or a refusal that names the reason when the graph path does not cover this use."""
    what = f"{type(style).__name__} on {type(cell).__name__}"
    n, rank = platform.world_size(group), platform.rank(group)
    try:
        if not style.use_local_output:
            raise ValueError("use_local_output=False (DTensor outputs) runs in PyNative "
                             "mode only")
        pre = post = None
        in_size, out_size = feature_lengths(kind, shape)
        if in_comm.forward != "none" or in_comm.backward != "none":
            pre = graph_boundary(in_comm, group.name, n, rank, in_size)
        if out_comm.forward != "none" or out_comm.backward != "none":
            post = graph_boundary(out_comm, group.name, n, rank, out_size)
        bias, share = (_graph_bias(style, platform, cell, kind, group)
                       if style.spec is ROWWISE else (None, 1.0))
    except ValueError as exc:
        refuse_graph_mode(cell, what, str(exc))
        return
    install_graph_hooks(cell, handles, pre, post, bias, share)


def _graph_bias(style: Any, platform: Platform, cell: nn.Cell, kind: str,
                group: MSGroup) -> tuple[Any, float]:
    if kind == "embedding":
        raise ValueError("a row-wise embedding masks the ids held elsewhere between its two "
                         "hooks, which runs in PyNative mode only")
    if cell._params.get("bias") is None:
        return None, 1.0
    n, rank = platform.world_size(group), platform.rank(group)
    plan = row_bias(style.output_layouts[0])  # as in PyNative
    return graph_boundary(plan.grad, group.name, n, rank), plan.share(rank)


def _shard_params(style: Any, platform: Platform, cell: nn.Cell, kind: str,
                  group: MSGroup) -> tuple[int, ...]:
    """Shard the parameters; return the weight's global shape."""
    shape: tuple[int, ...] = ()
    for spec_name, ms_name in param_names(cell, kind).items():
        param = cell._params.get(ms_name)
        if param is None:
            continue
        if spec_name == "weight":
            shape = tuple(param.shape)
        dim = style.spec.param_dims[kind].get(spec_name)
        new = shard_parameter(platform, cell, ms_name, dim, group, style.src_data_rank)
        if isinstance(cell, nn.Embedding) and dim == 1:
            cell.embedding_size = new.shape[1]  # nn.Embedding reshapes its output by it
    return shape


def _install_output(style: Any, platform: Platform, cell: nn.Cell, kind: str,
                           group: MSGroup, boundary_out: Boundary,
                           shape: tuple[int, ...], finish: Any) -> list[Any]:
    """Install the output side's PyNative hooks; return their handles."""
    if boundary_out.comm.forward != "none" or boundary_out.comm.backward != "none" or (
            not style.use_local_output):

        def relayout_output(_cell: nn.Cell, args: tuple, out: Any) -> Any:
            return finish(out, boundary_out(out))

        return [platform.register_forward_hook(cell, relayout_output)]
    return []


def _install_local_compute(style: Any, platform: Platform, cell: nn.Cell, kind: str,
                           group: MSGroup, boundary_out: Boundary,
                           shape: tuple[int, ...], finish: Any) -> list[Any]:
    if style.spec is not ROWWISE:
        return _install_output(style, platform, cell, kind, group, boundary_out, shape, finish)
    if kind == "linear":
        bias = cell._params.get("bias")
        if bias is None:
            return _install_output(style, platform, cell, kind, group, boundary_out, shape,
                                  finish)
        idle = zeros(bias.shape, bias.dtype)
        plan = row_bias(style.output_layouts[0])  # who adds the bias, its gradient's sum
        bias_share = plan.share(platform.rank(group))
        bias_path = (Boundary(platform, plan.grad, group) if plan.grad.backward != "none"
                     else None)

        saved: list[Any] = []

        def swap_out_bias(_cell: nn.Cell, args: tuple) -> None:
            saved.append(_cell._params["bias"])  # the one there now (a tie may replace it)
            _cell._params["bias"] = idle  # the local compute adds nothing

        def reduce_then_add_bias(_cell: nn.Cell, args: tuple, out: Any) -> Any:
            bias = saved.pop()
            _cell._params["bias"] = bias
            if bias_path is not None:
                bias = bias_path(bias)
            if bias_share != 1.0:  # a Partial output: one rank's bias in the sum
                bias = bias * bias_share
            return finish(out, boundary_out(out) + bias)

        return [platform.register_forward_pre_hook(cell, swap_out_bias),
                platform.register_forward_hook(cell, reduce_then_add_bias)]
    # Embedding: this rank holds rows [lo, hi) of the table; other ids look up zeros.
    lo, rows = local_range(style.spec, kind, "weight", shape, platform.world_size(group),
                           platform.rank(group))
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
