"""Styles that only convert a module's boundary tensors (``PrepareModuleInput``,
``PrepareModuleOutput``, ``PrepareModuleInputOutput``): no parameters are sharded."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hyperpar.dtensor.placement import Placement, Shard
from hyperpar.platform import get_platform
from hyperpar.torch.parallel._comm import full_length, needs_full_length, redistribute_boundary
from hyperpar.torch.parallel.style import (
    ParallelStyle,
    _global_shape,
    _local_and_layout,
    _one_d,
    _wrap,
    as_placement,
)

__all__ = ["PrepareModuleInput", "PrepareModuleInputOutput", "PrepareModuleOutput"]


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


def _layouts(value: Any) -> tuple[Placement | None, ...] | None:
    if value is None:
        return None
    if isinstance(value, tuple | list):
        return tuple(as_placement(v) for v in value)
    return (as_placement(value),)


def _kw_layouts(value: Any) -> dict[str, Placement | None]:
    return {k: as_placement(v) for k, v in (value or {}).items()}


class PrepareModuleInput(ParallelStyle):
    """Convert a module's inputs (positional: ``input_layouts`` -> ``desired_input_layouts``,
    one entry per argument, ``None`` passes through; keyword: the ``*_kwarg_layouts`` dicts)
    before its forward. Inputs come out as DTensors unless ``use_local_output=True``."""
    _claims = ("inputs",)

    def __init__(self, *, input_layouts: Any = None, desired_input_layouts: Any = None,
                 input_kwarg_layouts: dict[str, Any] | None = None,
                 desired_input_kwarg_layouts: dict[str, Any] | None = None,
                 use_local_output: bool = False) -> None:
        self.input_layouts = _layouts(input_layouts)
        self.desired_input_layouts = _layouts(desired_input_layouts)
        self.input_kwarg_layouts = _kw_layouts(input_kwarg_layouts)
        self.desired_input_kwarg_layouts = _kw_layouts(desired_input_kwarg_layouts)
        self.use_local_output = use_local_output
        if (self.input_layouts is None) != (self.desired_input_layouts is None) or (
            self.input_layouts is not None
            and len(self.input_layouts) != len(self.desired_input_layouts)
        ):
            raise ValueError(
                f"input_layouts {self.input_layouts} and desired_input_layouts "
                f"{self.desired_input_layouts} must have the same length"
            )
        if set(self.input_kwarg_layouts) != set(self.desired_input_kwarg_layouts):
            raise ValueError(
                f"input_kwarg_layouts keys {sorted(self.input_kwarg_layouts)} and "
                f"desired_input_kwarg_layouts keys {sorted(self.desired_input_kwarg_layouts)} "
                f"must match"
            )

    def _prepare(self, args: tuple, kwargs: dict, mesh: Any) -> tuple[tuple, dict]:
        if self.input_layouts is not None:
            if len(args) != len(self.input_layouts):  # torch's rule: one layout per input
                raise ValueError(
                    f"PrepareModuleInput: {len(self.input_layouts)} input layouts given but the "
                    f"module got {len(args)} positional inputs; give one layout per positional "
                    f"input (None leaves an input as it is)"
                )
            args = tuple(
                _convert(a, lay, want, mesh, self.use_local_output, f"input {i}")
                for i, (a, lay, want) in enumerate(
                    zip(args, self.input_layouts, self.desired_input_layouts, strict=False))
            ) + tuple(args[len(self.input_layouts):])
        if self.input_kwarg_layouts:
            kwargs = dict(kwargs)
            for key, lay in self.input_kwarg_layouts.items():
                if key in kwargs:
                    kwargs[key] = _convert(kwargs[key], lay, self.desired_input_kwarg_layouts[key],
                                           mesh, self.use_local_output, f"input {key!r}")
        return args, kwargs

    def _param_placements(self, module: nn.Module, owner: nn.Module, name: str) -> None:
        return None  # no parameter is touched

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        mesh = _one_d(device_mesh, self)
        get_platform().register_forward_pre_hook(
            module, lambda mod, args, kwargs: self._prepare(args, kwargs, mesh), with_kwargs=True
        )
        return module


class PrepareModuleOutput(ParallelStyle):
    """Convert a module's outputs (a tensor or a tuple; ``None`` entries pass through) from
    ``output_layouts`` to ``desired_output_layouts`` after its forward; local tensors unless
    ``use_local_output=False``."""
    _claims = ("outputs",)

    def __init__(self, *, output_layouts: Any, desired_output_layouts: Any,
                 use_local_output: bool = True) -> None:
        self.output_layouts = _layouts(output_layouts)
        self.desired_output_layouts = _layouts(desired_output_layouts)
        self.use_local_output = use_local_output
        if len(self.output_layouts) != len(self.desired_output_layouts):
            raise ValueError(
                f"output_layouts {self.output_layouts} and desired_output_layouts "
                f"{self.desired_output_layouts} must have the same length"
            )

    def _prepare(self, outputs: Any, mesh: Any) -> Any:
        single = not isinstance(outputs, tuple)
        items = (outputs,) if single else outputs
        if len(items) != len(self.output_layouts):
            raise ValueError(
                f"PrepareModuleOutput: {len(self.output_layouts)} output layouts given but the "
                f"module returned {len(items)} outputs"
            )
        out = tuple(
            _convert(o, lay, want, mesh, self.use_local_output, f"output {i}")
            for i, (o, lay, want) in enumerate(
                zip(items, self.output_layouts, self.desired_output_layouts, strict=True))
        )
        return out[0] if single else out

    def _param_placements(self, module: nn.Module, owner: nn.Module, name: str) -> None:
        return None  # no parameter is touched

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        mesh = _one_d(device_mesh, self)
        get_platform().register_forward_hook(
            module, lambda mod, args, outputs: self._prepare(outputs, mesh)
        )
        return module


class PrepareModuleInputOutput(ParallelStyle):
    """:class:`PrepareModuleInput` and :class:`PrepareModuleOutput` on one module
    (``use_local_input`` is the former's ``use_local_output``)."""
    _claims = ("inputs", "outputs")

    def __init__(self, *, input_layouts: Any = None, desired_input_layouts: Any = None,
                 input_kwarg_layouts: dict[str, Any] | None = None,
                 desired_input_kwarg_layouts: dict[str, Any] | None = None,
                 use_local_input: bool = False, output_layouts: Any,
                 desired_output_layouts: Any, use_local_output: bool = True) -> None:
        self.prepare_module_input = PrepareModuleInput(
            input_layouts=input_layouts, desired_input_layouts=desired_input_layouts,
            input_kwarg_layouts=input_kwarg_layouts,
            desired_input_kwarg_layouts=desired_input_kwarg_layouts,
            use_local_output=use_local_input,
        )
        self.prepare_module_output = PrepareModuleOutput(
            output_layouts=output_layouts, desired_output_layouts=desired_output_layouts,
            use_local_output=use_local_output,
        )

    def _param_placements(self, module: nn.Module, owner: nn.Module, name: str) -> None:
        return None  # no parameter is touched

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        self.prepare_module_input._apply(module, device_mesh)
        self.prepare_module_output._apply(module, device_mesh)
        return module
