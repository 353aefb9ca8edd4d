"""``parallelize_module`` and ``distribute_module`` (signatures of
``torch.distributed.tensor.parallel.parallelize_module`` / ``torch.distributed.tensor
.distribute_module``)."""

from __future__ import annotations

import difflib
import fnmatch
import re
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from hyperpar.platform import get_platform

from .style import ParallelStyle, UnsupportedModuleError

__all__ = ["distribute_module", "parallelize_module"]


class PlanKeyError(ValueError):
    """A ``parallelize_plan`` key matched no submodule."""


def _resolve_mesh(device_mesh: Any, tp_mesh_dim: str | int | None) -> Any:
    from hyperpar.dtensor.mesh import current_mesh

    mesh = device_mesh if device_mesh is not None else current_mesh()
    if mesh is None:
        raise ValueError("parallelize_module: no device_mesh given and no mesh is current "
                         "(pass device_mesh=init_device_mesh(...) or use `with mesh:`)")
    if tp_mesh_dim is not None:
        if isinstance(tp_mesh_dim, int):
            if mesh.ndim == 1 and tp_mesh_dim == 0:
                return mesh
            names = mesh.mesh_dim_names
            if not names:
                raise ValueError("tp_mesh_dim as an index needs a mesh with mesh_dim_names")
            tp_mesh_dim = names[tp_mesh_dim]
        return mesh if mesh.ndim == 1 and mesh.mesh_dim_names in (None, (tp_mesh_dim,)) \
            else mesh[tp_mesh_dim]
    if mesh.ndim == 1:
        return mesh
    if mesh.mesh_dim_names and "tp" in mesh.mesh_dim_names:
        return mesh["tp"]
    raise ValueError(
        f"parallelize_module got a {mesh.ndim}-D mesh {mesh!r} without a 'tp' dimension; pass "
        f"the tensor-parallel sub-mesh (mesh['<name>']) or tp_mesh_dim='<name>'"
    )


def _candidates(module: nn.Module) -> list[str]:
    names = [n for n, _ in module.named_modules() if n]
    generic = {re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)", "*", n) for n in names}
    return sorted(set(names) | generic)


def _apply_style(style: Any, module: nn.Module, mesh: Any, fqn: str, src_data_rank: int | None
                 ) -> None:
    if isinstance(style, Mapping):
        _parallelize(module, mesh, dict(style), src_data_rank, fqn)
        return
    if not isinstance(style, ParallelStyle):
        raise TypeError(
            f"plan entry for {fqn or 'the root module'!r} must be a hyperpar ParallelStyle or a "
            f"nested plan dict, got {type(style).__module__}.{type(style).__name__} (import the "
            f"styles from hyperpar, not torch.distributed.tensor.parallel)"
        )
    style.src_data_rank = src_data_rank
    try:
        style._apply(module, mesh)
    except UnsupportedModuleError as err:
        raise UnsupportedModuleError(
            f"cannot apply {type(style).__name__} to {fqn or '<root>'!r} "
            f"({type(module).__module__}.{type(module).__name__}): {err}"
        ) from None


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
    if parallelize_plan is None:
        warnings.warn("parallelize_module: no parallelize_plan given; the module is unchanged",
                      stacklevel=2)
        return module
    return _parallelize(module, mesh, parallelize_plan, src_data_rank, "")


def _parallelize(module: nn.Module, mesh: Any, parallelize_plan: Any,
                 src_data_rank: int | None, _prefix: str) -> nn.Module:
    if isinstance(parallelize_plan, ParallelStyle):
        _apply_style(parallelize_plan, module, mesh, _prefix, src_data_rank)
        return module
    if not isinstance(parallelize_plan, Mapping):
        raise TypeError(
            f"parallelize_plan must be a ParallelStyle or a dict {{fqn: style}}, got "
            f"{type(parallelize_plan).__name__}"
        )
    for key, style in parallelize_plan.items():
        if not isinstance(key, str) or not key:
            raise PlanKeyError(f"plan keys must be non-empty module paths, got {key!r}")
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
            full = f"{_prefix}.{fqn}" if _prefix else fqn
            _apply_style(style, sub, mesh, full, src_data_rank)
    return module


def distribute_module(module: nn.Module, device_mesh: Any = None,
                      partition_fn: Callable[[str, nn.Module, Any], None] | None = None,
                      input_fn: Callable[[nn.Module, Any, Any], Any] | None = None,
                      output_fn: Callable[[nn.Module, Any, Any], Any] | None = None
                      ) -> nn.Module:
    """Turn ``module``'s parameters into DTensors and hook its boundaries (torch semantics).

    ``partition_fn(name, submodule, mesh)`` is called for every submodule (default: replicate
    every parameter not already a DTensor); ``input_fn(module, inputs, mesh)`` runs as a forward
    pre-hook and ``output_fn(module, outputs, mesh)`` as a forward hook, each may return a
    replacement. The forward then runs with per-op DTensor dispatch -- use the styles for the
    fast path.
    """
    from hyperpar.dtensor import DTensor, Replicate, distribute_tensor
    from hyperpar.dtensor.mesh import _require_mesh

    mesh = _require_mesh(device_mesh, "distribute_module")
    platform = get_platform()
    if getattr(module, "_hyperpar_distributed", False):
        raise RuntimeError(f"distribute_module: {type(module).__name__} is already distributed")
    module._hyperpar_distributed = True  # type: ignore[assignment]

    def replicate_all(name: str, sub: nn.Module, mesh_: Any) -> None:
        for pname, param in list(sub._parameters.items()):
            if param is not None and not isinstance(param, DTensor):
                dt = distribute_tensor(param.detach(), mesh_, [Replicate()] * mesh_.ndim)
                platform.set_parameter(sub, pname, dt)

    for name, sub in module.named_modules():
        (partition_fn or replicate_all)(name, sub, mesh)
        if partition_fn is not None:
            replicate_all(name, sub, mesh)
    if input_fn is not None:
        platform.register_forward_pre_hook(module, lambda mod, args: input_fn(mod, args, mesh))
    if output_fn is not None:
        platform.register_forward_hook(
            module, lambda mod, args, out: output_fn(mod, out, mesh)
        )
    return module
