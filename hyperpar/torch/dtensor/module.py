"""``distribute_module``: a module's parameters and buffers as DTensors, with user hooks at its
boundaries -- torch's ``torch.distributed.tensor.distribute_module`` (same signature and
defaults). The parallel styles are built beside it, not on it: they run Linear/Embedding on
local shards, whereas a module given to ``distribute_module`` runs op by op on DTensors.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from torch import nn

from hyperpar.dtensor.errors import AlreadyParallelizedError
from hyperpar.dtensor.mesh import DeviceMesh, _require_mesh
from hyperpar.dtensor.placement import Replicate
from hyperpar.platform import get_platform
from hyperpar.torch.dtensor.api import DTensor, distribute_tensor

__all__ = ["AlreadyParallelizedError", "distribute_module"]

#: set on a module given to :func:`distribute_module` (it may be given once)
_DISTRIBUTED = "_hyperpar_distributed"
#: set on a module by a parallel style (``hyperpar.torch.parallel.style``): {claim: style repr}
_STYLED = "_hyperpar_parallel"


def replicate_params_and_buffers(module: nn.Module, mesh: DeviceMesh) -> None:
    """Make ``module``'s own parameters and buffers that are not DTensors yet replicated
    DTensors on ``mesh`` (the default partition of :func:`distribute_module`)."""
    everywhere = (Replicate(),) * mesh.ndim
    platform = get_platform()
    for name, param in list(module._parameters.items()):
        if param is not None and not isinstance(param, DTensor):
            platform.set_parameter(module, name,
                                   distribute_tensor(param.detach(), mesh, everywhere))
    for name, buf in list(module._buffers.items()):
        if buf is not None and not isinstance(buf, DTensor):
            module._buffers[name] = distribute_tensor(buf, mesh, everywhere)


def _boundary_fn(fn: Callable[..., Any], what: str) -> Callable[..., Any]:
    """``fn(module, value, mesh)``; torch also accepts the older two-argument form
    ``fn(value, mesh)`` for ``input_fn`` / ``output_fn``, so this does too."""
    try:
        positional = [p for p in inspect.signature(fn).parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):  # a builtin or C callable: assume the current form
        return fn
    if len(positional) == 2:
        return lambda module, value, mesh: fn(value, mesh)
    if len(positional) != 3 and not any(
            p.kind == p.VAR_POSITIONAL for p in inspect.signature(fn).parameters.values()):
        raise ValueError(
            f"distribute_module: {what} must take (module, {what.split('_')[0]}s, device_mesh)"
            f" (or the older (inputs, device_mesh)); {fn!r} takes {len(positional)} arguments"
        )
    return fn


def _check_not_parallelized(module: nn.Module) -> None:
    for fqn, sub in module.named_modules():
        where = f"{fqn!r}" if fqn else "the root module"
        styles = getattr(sub, _STYLED, None)
        if getattr(sub, _DISTRIBUTED, False) or styles:
            how = "distribute_module" if not styles else ", ".join(sorted(set(styles.values())))
            raise AlreadyParallelizedError(
                f"distribute_module: {where} ({type(sub).__name__}) is already parallelized "
                f"({how} was applied to it); applying distribute_module again would hook it "
                f"twice. Rebuild the model and distribute the fresh one"
            )
        done = [n for n, p in sub.named_parameters(recurse=False) if isinstance(p, DTensor)]
        if done:
            raise AlreadyParallelizedError(
                f"distribute_module: parameters {done[:3]} of {where} ({type(sub).__name__}) are "
                f"DTensors already; distribute_module takes a module with plain parameters"
            )


def distribute_module(module: nn.Module, device_mesh: DeviceMesh | None = None,
                      partition_fn: Callable[[str, nn.Module, DeviceMesh], None] | None = None,
                      input_fn: Callable[[nn.Module, Any, DeviceMesh], Any] | None = None,
                      output_fn: Callable[[nn.Module, Any, DeviceMesh], Any] | None = None
                      ) -> nn.Module:
    """Turn ``module``'s parameters and buffers into DTensors and hook its boundaries, in
    place; returns ``module`` (torch's semantics).

    ``device_mesh``: default the current mesh (``with mesh:``).
    ``partition_fn(name, submodule, mesh)`` is called for every submodule and may shard its
    parameters (``distribute_tensor`` + ``register_parameter``); whatever it leaves plain --
    every parameter and buffer when it is ``None`` -- is replicated. ``input_fn(module, inputs,
    mesh)`` runs as a forward pre-hook and ``output_fn(module, outputs, mesh)`` as a forward
    hook; each may return a replacement. The forward then runs with per-op DTensor dispatch;
    the parallel styles (``parallelize_module``) are the fast path for Linear/Embedding.
    A module can be distributed once: a second call raises :class:`AlreadyParallelizedError`.
    """
    mesh = _require_mesh(device_mesh, "distribute_module")
    pre = _boundary_fn(input_fn, "input_fn") if input_fn is not None else None
    post = _boundary_fn(output_fn, "output_fn") if output_fn is not None else None
    _check_not_parallelized(module)
    platform = get_platform()
    module.__dict__[_DISTRIBUTED] = True
    for name, sub in module.named_modules():
        if partition_fn is not None:
            partition_fn(name, sub, mesh)
        replicate_params_and_buffers(sub, mesh)
    if pre is not None:
        platform.register_forward_pre_hook(module, lambda mod, args: pre(mod, args, mesh))
    if post is not None:
        platform.register_forward_hook(module, lambda mod, args, out: post(mod, out, mesh))
    return module
