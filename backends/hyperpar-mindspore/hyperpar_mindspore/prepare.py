"""MindSpore's mechanics of sequence parallelism and boundary re-layouts (``SequenceParallel``,
``PrepareModuleInput``, ``PrepareModuleOutput``, ``PrepareModuleInputOutput``), and
:data:`MECHANICS`, what ``MindSporePlatform.tp_mechanics()`` returns.

The styles are hyperpar's one set (:mod:`hyperpar.parallel.styles`), the same classes as on
PyTorch. Their meaning comes from :mod:`hyperpar.parallel.spec` (:func:`~hyperpar.parallel.spec.
sequence_parallel`, :data:`~hyperpar.parallel.spec.REPLICATED_PARAM_GRAD`,
:func:`~hyperpar.parallel.spec.prepare_comm`); the mechanics are those of :mod:`.parallel`:
boundary Cells with a custom ``bprop`` run from forward hooks. ``use_local_output=False`` gives
MindSpore DTensors (:mod:`.dtensor`); when ``use_local_output`` is not passed, activations are
local tensors whose layout the plan declares (MindSpore's difference: torch's
``SequenceParallel`` and ``PrepareModuleInput`` default to DTensors). A DTensor input is
redistributed to the declared layout first. Uneven pieces follow ``torch.chunk``, as on PyTorch.

A Megatron sequence-parallel block::

    {"norm": SequenceParallel(),                                  # on this rank's positions
     "fc1": ColwiseParallel(input_layouts=Shard(1)),              # all-gather the sequence
     "fc2": RowwiseParallel(output_layouts=Shard(1))}             # reduce-scatter it
"""

from __future__ import annotations

from typing import Any

from mindspore import Tensor, nn

from hyperpar.dtensor.mesh import DeviceMesh
from hyperpar.dtensor.placement import Placement, Replicate, Shard
from hyperpar.parallel.prepare_plan import Convert, entries, prepare_inputs, prepare_outputs
from hyperpar.parallel.spec import REPLICATED_PARAM_GRAD, check_reachable, prepare_comm
from hyperpar.parallel.styles import (
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    SequenceParallel,
)
from hyperpar.platform import get_platform

from .comm import KERNELS, Boundary
from .graph import refuse_graph_mode
from .parallel import (
    _shard,
    as_local,
    check_sharding_style,
    param_names,
    wrap_output,
)
from .param_readback import attach_full_tensor
from .tensors import SHARD_PLACEMENTS

__all__ = ["MECHANICS", "MindSporeMechanics", "PrepareModuleInput", "PrepareModuleInputOutput",
           "PrepareModuleOutput", "SequenceParallel"]


def _sequence_parallel(style: Any, cell: nn.Cell, mesh: DeviceMesh) -> nn.Cell:
    """SequenceParallel on ``cell``: rank ``src_data_rank``'s parameters everywhere, their
    gradients all-reduced, the forward on this rank's slice."""
    platform = get_platform()
    group = mesh.get_group(0)
    src = style.src_data_rank  # one of the group's ranks: the neutral style checked it
    # Every parameter slot of the Cell and its sub-Cells, each held by the Cell that owns it.
    owners = [(sub, name) for _path, sub in platform.named_modules(cell)
              for name, _ in platform.named_parameters(sub, recurse=False)]
    done: set[int] = set()
    for sub, name in owners:  # rank src's values everywhere (None: each rank its own)
        param = sub._params[name]
        if id(param) in done:
            continue
        done.add(id(param))
        if src is not None:
            full = Tensor(param.asnumpy())
            platform.broadcast(full, group.ranks[src], group)
            param.set_data(full)
        setattr(param, SHARD_PLACEMENTS, (Replicate(),))
        attach_full_tensor(param, mesh, (Replicate(),), tuple(param.shape))
    grad_sum = Boundary(platform, REPLICATED_PARAM_GRAD, group, "SequenceParallel parameter")
    saved: list[list[Any]] = []

    seq, use_local = Shard(style.sequence_dim), style.use_local_output

    def use_summed_grads(_cell: nn.Cell, args: tuple) -> tuple | None:
        now = [sub._params[name] for sub, name in owners]  # a tie may have replaced one
        saved.append(now)
        for (sub, name), param in zip(owners, now, strict=True):
            sub._params[name] = grad_sum(param)  # the forward sees the parameter itself
        if args and isinstance(args[0], Tensor):  # a DTensor: to this rank's slice
            return (as_local(args[0], seq, "SequenceParallel input"), *args[1:])
        return None

    def restore(_cell: nn.Cell, args: tuple, out: Any) -> Any:
        for (sub, name), param in zip(owners, saved.pop(), strict=True):
            sub._params[name] = param
        if use_local or not isinstance(out, Tensor):
            return None
        return wrap_output(out, mesh, seq, None, "SequenceParallel output")

    platform.register_forward_pre_hook(cell, use_summed_grads)
    platform.register_forward_hook(cell, restore)
    refuse_graph_mode(cell, "SequenceParallel", "its hooks swap parameters, which a "
                      "compiled graph does not replay")
    return cell


def _convert(style: Any, mesh: DeviceMesh, use_local: bool) -> Convert:
    """MindSpore's re-layout of one boundary tensor (the walk is :mod:`~hyperpar.parallel.
    prepare_plan`'s): a boundary Cell per entry of ``style``, built once here. A DTensor is
    first redistributed to the declared layout; a sequence length that is not a torch.chunk
    split is caught by the boundary, on every rank, before it communicates."""
    platform, group = get_platform(), mesh.get_group(0)
    boundaries = {what: (f"{name} {what}", Boundary(platform, prepare_comm(src, dst), group,
                                                    f"{name} {what} ({src} -> {dst})"))
                  for name, what, src, dst in entries(style) if src is not None}

    def convert(x: Tensor, layout: Placement, desired: Placement, what: str) -> Any:
        where, boundary = boundaries[what]
        y = boundary(as_local(x, layout, where))
        return y if use_local else wrap_output(y, mesh, desired, None, where)

    return convert


def _prepare_inputs(style: Any, cell: nn.Cell, mesh: DeviceMesh) -> nn.Cell:
    if style.input_layouts is None and not style.input_kwarg_layouts:
        return cell
    convert = _convert(style, mesh, style.use_local_output)

    def before(_cell: nn.Cell, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return prepare_inputs(style, tuple(args), kwargs, convert, Tensor)

    get_platform().register_forward_pre_hook(cell, before, with_kwargs=True)
    refuse_graph_mode(cell, "PrepareModuleInput", "its re-layouts run in PyNative mode only")
    return cell


def _prepare_outputs(style: Any, cell: nn.Cell, mesh: DeviceMesh) -> nn.Cell:
    convert = _convert(style, mesh, style.use_local_output)

    def after(_cell: nn.Cell, args: tuple, out: Any) -> Any:
        return prepare_outputs(style, out, convert, Tensor)

    get_platform().register_forward_hook(cell, after)
    refuse_graph_mode(cell, "PrepareModuleOutput", "its re-layouts run in PyNative mode only")
    return cell


class MindSporeMechanics:
    """What the neutral styles do to an ``nn.Cell`` (the ``Mechanics`` protocol of
    :mod:`hyperpar.parallel.styles`)."""

    #: MindSpore's difference: these give local tensors unless use_local_output is passed
    local_by_default: frozenset[str] = frozenset({"SequenceParallel", "PrepareModuleInput"})
    #: MindSpore's kernels refuse empty tensors: a split leaving a rank none is refused up front
    refuses_empty_pieces: str | None = KERNELS

    def check_style(self, style: Any) -> None:
        """Refuse at construction a layout no MindSpore boundary reaches (a ``Partial``
        column-parallel output: PyTorch redistributes to one, MindSpore's boundaries cannot)."""
        check_reachable(type(style).__name__, style.spec, style.input_layouts[0],
                        style.output_layouts[0])

    def check_applicable(self, style: Any, cell: nn.Cell, fqn: str) -> None:
        check_sharding_style(style, cell, fqn)

    def param_names(self, cell: nn.Cell, kind: str) -> dict[str, str]:
        return param_names(cell, kind)

    def before_apply(self, style: Any, cell: nn.Cell, mesh: DeviceMesh, fqn: str) -> None:
        """Nothing (PyTorch installs its debug input checks here)."""

    def shard(self, style: Any, cell: nn.Cell, mesh: DeviceMesh, kind: str) -> nn.Cell:
        return _shard(style, cell, mesh, kind)

    def sequence_parallel(self, style: Any, cell: nn.Cell, mesh: DeviceMesh) -> nn.Cell:
        return _sequence_parallel(style, cell, mesh)

    def prepare_inputs(self, style: Any, cell: nn.Cell, mesh: DeviceMesh) -> nn.Cell:
        return _prepare_inputs(style, cell, mesh)

    def prepare_outputs(self, style: Any, cell: nn.Cell, mesh: DeviceMesh) -> nn.Cell:
        return _prepare_outputs(style, cell, mesh)


#: the one instance ``MindSporePlatform.tp_mechanics()`` returns
MECHANICS = MindSporeMechanics()
