"""``parallelize_module`` and ``distribute_module`` (signatures of
``torch.distributed.tensor.parallel.parallelize_module`` / ``torch.distributed.tensor
.distribute_module``)."""

from __future__ import annotations

import difflib
import fnmatch
import re
import warnings
from collections.abc import Mapping
from typing import Any

from torch import nn

from hyperpar.dtensor.module import distribute_module

from ._debug_checks import install_input_checks
from ._ties import check_ties, find_ties, retie
from .style import (
    ParallelStyle,
    UnsupportedModuleError,
)

__all__ = ["distribute_module", "parallelize_module"]


class PlanKeyError(ValueError):
    """A ``parallelize_plan`` key matched no submodule."""


def _resolve_mesh(device_mesh: Any, tp_mesh_dim: str | int | None) -> Any:
    from hyperpar.dtensor.mesh import _require_mesh

    # a 1-D mesh whole, else dim tp_mesh_dim (name or index), else the dim named "tp"
    return _require_mesh(device_mesh, "parallelize_module").get_mesh(tp_mesh_dim, default="tp")


def _candidates(module: nn.Module) -> list[str]:
    names = [n for n, _ in module.named_modules() if n]
    generic = {re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)", "*", n) for n in names}
    return sorted(set(names) | generic)


def _apply_style(style: ParallelStyle, module: nn.Module, mesh: Any, fqn: str,
                 src_data_rank: int | None) -> None:
    style.src_data_rank = src_data_rank
    install_input_checks(style, module, mesh, fqn)  # HYPERPAR_DEBUG_COLLECTIVES=1 only
    try:
        style._apply(module, mesh)
    except UnsupportedModuleError as err:
        raise UnsupportedModuleError(
            f"cannot apply {type(style).__name__} to {fqn or '<root>'!r} "
            f"({type(module).__module__}.{type(module).__name__}): {err}"
        ) from None
    style._mark_applied(module)


def _match(module: nn.Module, atoms: list[str]) -> list[tuple[str, nn.Module]]:
    found = [("", module)]
    for atom in atoms:
        found = [
            (f"{prefix}.{name}" if prefix else name, child)
            for prefix, parent in found
            for name, child in parent.named_children()
            if fnmatch.fnmatchcase(name, atom)
        ]
    return found


def parallelize_module(module: nn.Module, device_mesh: Any = None,
                       parallelize_plan: ParallelStyle | dict[str, Any] | None = None, *,
                       src_data_rank: int | None = 0, tp_mesh_dim: str | int | None = None
                       ) -> nn.Module:
    """Apply a parallel style, or a plan ``{fqn: style}``, to ``module`` in place.

    Plan keys are dotted module paths with ``fnmatch`` wildcards per level
    (``"layers.*.attention.wq"``); a value may itself be a plan dict, applied to every module
    the key matched. A key matching nothing raises, naming the closest paths. On an n-D mesh the
    tensor-parallel dimension is ``tp_mesh_dim`` (default: the dimension named ``"tp"``).
    ``src_data_rank``: rank whose full parameters are scattered (``None``: each rank uses its
    own copy). Returns ``module``.
    """
    mesh = _resolve_mesh(device_mesh, tp_mesh_dim)
    converted = from_torch_style(parallelize_plan)
    if converted is not None:
        parallelize_plan = converted
    if parallelize_plan is None:
        warnings.warn("parallelize_module: no parallelize_plan given; the module is unchanged",
                      stacklevel=2)
        return module
    # Resolve and check the whole plan first: a bad entry must leave the model untouched.
    entries = _resolve_plan(module, parallelize_plan, "")
    pending: dict[int, dict[str, str]] = {}
    for fqn, sub, style in entries:
        style._check_applicable(sub, fqn, pending.get(id(sub)))
        pending.setdefault(id(sub), {}).update({c: repr(style) for c in style._claimed()})
    ties = find_ties(module)
    check_ties(ties, entries)
    for fqn, sub, style in entries:
        _apply_style(style, sub, mesh, fqn, src_data_rank)
    retie(ties)  # a parameter shared before stays one parameter (torch splits it)
    return module


def _resolve_plan(module: nn.Module, plan: Any, _prefix: str
                  ) -> list[tuple[str, nn.Module, ParallelStyle]]:
    """``(path, module, style)`` for every entry of ``plan`` (nested dicts expanded), in
    application order; raises on a bad entry without changing anything."""
    if isinstance(plan, ParallelStyle):
        return [(_prefix, module, plan)]
    converted = from_torch_style(plan, _prefix)
    if converted is not None:
        return [(_prefix, module, converted)]
    if not isinstance(plan, Mapping):
        what = "parallelize_plan" if not _prefix else f"plan entry for {_prefix!r}"
        raise TypeError(
            f"{what} must be a hyperpar ParallelStyle or a dict {{fqn: style}}, got "
            f"{type(plan).__module__}.{type(plan).__name__} (import the styles from hyperpar, "
            f"not torch.distributed.tensor.parallel)"
        )
    entries = []
    for key, style in plan.items():
        if not isinstance(key, str):
            raise PlanKeyError(f"plan keys must be module paths (str), got {key!r}")
        if key == "":  # torch: the module the plan is applied to
            entries += _resolve_plan(module, style, _prefix)
            continue
        matches = _match(module, key.split("."))
        if not matches:
            close = difflib.get_close_matches(key, _candidates(module), n=3, cutoff=0.4)
            where = f" under {_prefix!r}" if _prefix else ""
            hint = (", ".join(repr(c) for c in close)) or "(no similar paths)"
            raise PlanKeyError(
                f"plan key {key!r} matched nothing{where} in {type(module).__name__}; "
                f"closest: {hint}"
            )
        for fqn, sub in matches:
            entries += _resolve_plan(sub, style, f"{_prefix}.{fqn}" if _prefix else fqn)
    return entries


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
    from . import prepare
    from . import style as styles

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
