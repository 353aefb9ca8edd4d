"""PyTorch's mechanics of the parallel styles (:mod:`hyperpar.parallel.styles`): the boundary
re-layouts of ``PrepareModuleInput`` / ``PrepareModuleOutput`` / ``PrepareModuleInputOutput``,
and :data:`MECHANICS`, what ``TorchPlatformBase.tp_mechanics()`` returns."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hyperpar.dtensor.placement import Placement, Shard
from hyperpar.parallel.prepare_plan import Convert, label, prepare_inputs, prepare_outputs
from hyperpar.parallel.styles import (
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
)
from hyperpar.platform import get_platform
from hyperpar.torch.parallel._comm import full_length, needs_full_length, redistribute_boundary
from hyperpar.torch.parallel._debug_checks import install_input_checks
from hyperpar.torch.parallel.style import (
    _colwise,
    _global_shape,
    _local_and_layout,
    _rowwise,
    _sequence_parallel,
    _wrap,
)

__all__ = ["MECHANICS", "PrepareModuleInput", "PrepareModuleInputOutput", "PrepareModuleOutput",
           "TorchMechanics"]


def _convert(mesh: Any, use_local: bool) -> Convert:
    """This stack's re-layout of one boundary tensor (the walk is :mod:`~hyperpar.parallel.
    prepare_plan`'s): a DTensor or a local tensor declared ``layout``, to ``desired``."""

    def convert(x: torch.Tensor, layout: Placement, desired: Placement, what: str) -> Any:
        local, src, full = _local_and_layout(x, layout, label(what))
        if full is None and type(src) is Shard and (
                not use_local or needs_full_length(src, desired, local.dim(), mesh)):
            full = full_length(local, src.dim % local.dim(), mesh)
        shape = None if use_local else _global_shape(local, src, full, mesh)
        y = redistribute_boundary(local, src, desired, mesh, full=full)
        return _wrap(y, mesh, desired, use_local, shape)

    return convert


class TorchMechanics:
    """What the neutral styles do to an ``nn.Module`` (the ``Mechanics`` protocol of
    :mod:`hyperpar.parallel.styles`)."""

    #: torch's defaults: SequenceParallel and PrepareModuleInput give DTensors
    local_by_default: frozenset[str] = frozenset()
    #: torch computes on empty pieces (``torch.chunk``'s ``[2, 2, 2, 0]``): no refusal
    refuses_empty_pieces: str | None = None
    #: a column-parallel Linear can save its all-gathered input as the shard (saved-tensor
    #: hooks, :func:`hyperpar.torch.parallel._comm.reshard_scope`)
    reshards_gathered_input: bool = True

    def check_style(self, style: Any) -> None:
        """Every layout the styles accept has a boundary here (``Partial`` outputs too)."""

    def check_applicable(self, style: Any, module: nn.Module, fqn: str) -> None:
        """Nothing beyond the neutral checks."""

    def param_names(self, module: nn.Module, kind: str) -> dict[str, str]:
        """``nn.Linear`` / ``nn.Embedding`` use the spec's names."""
        return {"weight": "weight", "bias": "bias"} if kind == "linear" else {"weight": "weight"}

    def before_apply(self, style: Any, module: nn.Module, mesh: Any, fqn: str) -> None:
        install_input_checks(style, module, mesh, fqn)  # HYPERPAR_DEBUG_COLLECTIVES=1 only

    def shard(self, style: Any, module: nn.Module, mesh: Any, kind: str) -> nn.Module:
        return (_colwise if style.spec.name == "ColwiseParallel" else _rowwise)(
            style, module, mesh, kind)

    def sequence_parallel(self, style: Any, module: nn.Module, mesh: Any) -> nn.Module:
        return _sequence_parallel(style, module, mesh)

    def prepare_inputs(self, style: Any, module: nn.Module, mesh: Any) -> nn.Module:
        convert = _convert(mesh, style.use_local_output)
        get_platform().register_forward_pre_hook(
            module, lambda mod, args, kwargs: prepare_inputs(style, args, kwargs, convert,
                                                             torch.Tensor),
            with_kwargs=True)
        return module

    def prepare_outputs(self, style: Any, module: nn.Module, mesh: Any) -> nn.Module:
        convert = _convert(mesh, style.use_local_output)
        get_platform().register_forward_hook(
            module, lambda mod, args, outputs: prepare_outputs(style, outputs, convert,
                                                               torch.Tensor))
        return module


#: the one instance ``TorchPlatformBase.tp_mechanics()`` returns
MECHANICS = TorchMechanics()
