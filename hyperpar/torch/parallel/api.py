"""``parallelize_module`` and ``distribute_module`` (signatures of
``torch.distributed.tensor.parallel.parallelize_module`` / ``torch.distributed.tensor
.distribute_module``) on PyTorch.

``parallelize_module`` is the framework-neutral driver (:mod:`hyperpar.parallel.driver`); this
module adds what only PyTorch has: a plan value that is a ``torch.distributed.tensor.parallel``
style is run as its hyperpar twin (:func:`from_torch_style`, registered with the driver)."""

from __future__ import annotations

from typing import Any

from hyperpar.parallel.driver import PlanKeyError, parallelize_module, register_plan_converter
from hyperpar.torch.dtensor.module import distribute_module
from hyperpar.torch.parallel.style import ParallelStyle

__all__ = ["PlanKeyError", "distribute_module", "from_torch_style", "parallelize_module"]


_TORCH_STYLES = ("ColwiseParallel", "RowwiseParallel", "SequenceParallel", "PrepareModuleInput",
                 "PrepareModuleOutput", "PrepareModuleInputOutput")


def from_torch_style(style: Any, where: str = "") -> ParallelStyle | None:
    """The hyperpar style equal to a ``torch.distributed.tensor.parallel`` style object (same
    class name, same settings), so a plan that kept one torch import still runs; ``None`` if
    ``style`` is not from torch. A torch style hyperpar has no twin of (a custom subclass)
    raises, naming what to use."""
    cls = type(style)
    if not cls.__module__.startswith("torch.distributed"):
        return None
    from hyperpar.torch.parallel import prepare
    from hyperpar.torch.parallel import style as styles

    name = cls.__name__
    if name not in _TORCH_STYLES or cls.__module__ != "torch.distributed.tensor.parallel.style":
        at = f" (plan entry {where!r})" if where else ""
        raise TypeError(
            f"{cls.__module__}.{name}{at} is a torch style hyperpar cannot run: subclass "
            f"hyperpar.ParallelStyle instead (override _apply(module, device_mesh)); hyperpar's "
            f"own styles are hyperpar.{', hyperpar.'.join(_TORCH_STYLES)}"
        )
    if name in ("ColwiseParallel", "RowwiseParallel"):
        out: ParallelStyle = getattr(styles, name)(
            input_layouts=style.input_layouts[0], output_layouts=style.output_layouts[0],
            use_local_output=style.use_local_output)
    elif name == "SequenceParallel":
        out = styles.SequenceParallel(sequence_dim=style.sequence_sharding[0].dim,
                                      use_local_output=style.use_local_output)
    elif name == "PrepareModuleInputOutput":
        pin, pout = style.prepare_module_input, style.prepare_module_output
        out = prepare.PrepareModuleInputOutput(
            input_layouts=pin.input_layouts, desired_input_layouts=pin.desired_input_layouts,
            input_kwarg_layouts=pin.input_kwarg_layouts or None,
            desired_input_kwarg_layouts=pin.desired_input_kwarg_layouts or None,
            use_local_input=pin.use_local_output, output_layouts=pout.output_layouts,
            desired_output_layouts=pout.desired_output_layouts,
            use_local_output=pout.use_local_output)
    elif name == "PrepareModuleInput":
        out = prepare.PrepareModuleInput(
            input_layouts=style.input_layouts, desired_input_layouts=style.desired_input_layouts,
            input_kwarg_layouts=style.input_kwarg_layouts or None,
            desired_input_kwarg_layouts=style.desired_input_kwarg_layouts or None,
            use_local_output=style.use_local_output)
    else:
        out = prepare.PrepareModuleOutput(
            output_layouts=style.output_layouts,
            desired_output_layouts=style.desired_output_layouts,
            use_local_output=style.use_local_output)
    return out


register_plan_converter(from_torch_style)
