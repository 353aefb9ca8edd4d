"""PyTorch's mechanics of the parallel styles (:mod:`hyperpar.parallel.styles`): the boundary
re-layouts of ``PrepareModuleInput`` / ``PrepareModuleOutput`` / ``PrepareModuleInputOutput``,
and :data:`MECHANICS`, what ``TorchPlatformBase.tp_mechanics()`` returns."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hyperpar.dtensor.placement import Placement, Shard
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


def _convert(x: Any, layout: Placement | None, desired: Placement | None, mesh: Any,
             use_local: bool, what: str) -> Any:
    if layout is None:
        return x
    if desired is None:
        raise ValueError(f"{what}: a desired layout is required where a layout is given")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what}: expected a tensor for layout {layout!r}, got {type(x).__name__}")
    local, src, full = _local_and_layout(x, layout)
    if full is None and type(src) is Shard and (
            not use_local or needs_full_length(src, desired, local.dim(), mesh)):
        full = full_length(local, src.dim % local.dim(), mesh)
    shape = None if use_local else _global_shape(local, src, full, mesh)
    y = redistribute_boundary(local, src, desired, mesh, full=full)
    return _wrap(y, mesh, desired, use_local, shape)


def _prepare_inputs(style: Any, args: tuple, kwargs: dict, mesh: Any) -> tuple[tuple, dict]:
    if style.input_layouts is not None:
        if len(args) != len(style.input_layouts):  # torch's rule: one layout per input
            raise ValueError(
                f"PrepareModuleInput: {len(style.input_layouts)} input layouts given but the "
                f"module got {len(args)} positional inputs; give one layout per positional "
                f"input (None leaves an input as it is)"
            )
        args = tuple(
            _convert(a, lay, want, mesh, style.use_local_output, f"input {i}")
            for i, (a, lay, want) in enumerate(
                zip(args, style.input_layouts, style.desired_input_layouts, strict=False))
        ) + tuple(args[len(style.input_layouts):])
    if style.input_kwarg_layouts:
        kwargs = dict(kwargs)
        for key, lay in style.input_kwarg_layouts.items():
            if key in kwargs:
                kwargs[key] = _convert(kwargs[key], lay, style.desired_input_kwarg_layouts[key],
                                       mesh, style.use_local_output, f"input {key!r}")
    return args, kwargs


def _prepare_outputs(style: Any, outputs: Any, mesh: Any) -> Any:
    single = not isinstance(outputs, tuple)
    items = (outputs,) if single else outputs
    if len(items) != len(style.output_layouts):
        raise ValueError(
            f"PrepareModuleOutput: {len(style.output_layouts)} output layouts given but the "
            f"module returned {len(items)} outputs"
        )
    out = tuple(
        _convert(o, lay, want, mesh, style.use_local_output, f"output {i}")
        for i, (o, lay, want) in enumerate(
            zip(items, style.output_layouts, style.desired_output_layouts, strict=True))
    )
    return out[0] if single else out


class TorchMechanics:
    """What the neutral styles do to an ``nn.Module`` (the ``Mechanics`` protocol of
    :mod:`hyperpar.parallel.styles`)."""

    #: torch's defaults: SequenceParallel and PrepareModuleInput give DTensors
    local_by_default: frozenset[str] = frozenset()

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
            style, module, mesh)

    def sequence_parallel(self, style: Any, module: nn.Module, mesh: Any) -> nn.Module:
        return _sequence_parallel(style, module, mesh)

    def prepare_inputs(self, style: Any, module: nn.Module, mesh: Any) -> nn.Module:
        get_platform().register_forward_pre_hook(
            module, lambda mod, args, kwargs: _prepare_inputs(style, args, kwargs, mesh),
            with_kwargs=True)
        return module

    def prepare_outputs(self, style: Any, module: nn.Module, mesh: Any) -> nn.Module:
        get_platform().register_forward_hook(
            module, lambda mod, args, outputs: _prepare_outputs(style, outputs, mesh))
        return module


#: the one instance ``TorchPlatformBase.tp_mechanics()`` returns
MECHANICS = TorchMechanics()
