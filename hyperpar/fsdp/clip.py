"""``clip_grad_norm_`` for parameters split by fully_shard, tensor and pipeline parallelism.

The norm is the one a single process would compute on the whole model: each rank sums the
squares (or takes the max) of its own gradient pieces, counting a piece replicated over a mesh
dim only once, and the partial results are reduced over every mesh dim that splits them (and,
for pipeline stages, over ``group``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from hyperpar.platform import get_platform
from hyperpar.torch.dtensor.api import DTensor

__all__ = ["clip_grad_norm_"]


def _local_grads(params: Iterable[torch.Tensor]) -> list[tuple[torch.Tensor, Any]]:
    out = []
    for p in params:
        if isinstance(p, DTensor):
            g = p.to_local().grad
            if g is not None:
                out.append((g, p))
        elif p.grad is not None:
            out.append((p.grad, None))
    return out


def clip_grad_norm_(parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float,
                    norm_type: float = 2.0, *, error_if_nonfinite: bool = False,
                    foreach: bool | None = None, pp_group: Any = None) -> torch.Tensor:
    """Clip the gradients of ``parameters`` in place so that their total norm is at most
    ``max_norm``; returns the total norm (a plain tensor, equal on every rank).

    Works for plain, tensor-parallel and fully_shard parameters alike (``torch.nn.utils``'s
    version would see only local pieces). Pipeline stages hold different parameters: pass the
    pipeline group as ``pp_group`` to include every stage's gradients.
    """
    del foreach
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = _local_grads(list(parameters))
    platform = get_platform()
    norm_type = float(norm_type)
    inf = math.isinf(norm_type)
    device = grads[0][0].device if grads else platform.device()
    # partial results keyed by the mesh groups they must be reduced over
    partial: dict[tuple, torch.Tensor] = {}
    groups_of: dict[tuple, list[Any]] = {}
    for g, p in grads:
        g32 = g.detach().float()
        value = g32.abs().max() if inf else g32.abs().pow(norm_type).sum()
        key: tuple = ()
        groups: list[Any] = []
        if p is not None:
            mesh = p.device_mesh
            for dim, placement in enumerate(p.placements):
                if placement.is_replicate():
                    continue
                if placement.is_partial():
                    raise ValueError(
                        "clip_grad_norm_: a gradient is Partial (pending reduction); finish "
                        "backward (or redistribute it) before clipping")
                names = mesh.mesh_dim_names or ()
                key += ((names, mesh.shape, dim),)
                groups.append(mesh.get_group(dim))
        prev = partial.get(key)
        partial[key] = value if prev is None else (torch.maximum(prev, value) if inf
                                                   else prev + value)
        groups_of[key] = groups
    total = torch.zeros((), dtype=torch.float32, device=device)
    # every rank reduces the same keys in the same order: keys hold mesh dim names and
    # shapes (equal on every rank), never rank lists or ids
    for key in sorted(partial, key=repr):
        value = partial[key].to(device).reshape(1).clone()
        for group in groups_of[key]:
            platform.all_reduce(value, op="max" if inf else "sum", group=group)
        total = torch.maximum(total, value[0]) if inf else total + value[0]
    if pp_group is not None:
        t = total.reshape(1).clone()
        platform.all_reduce(t, op="max" if inf else "sum", group=pp_group)
        total = t[0]
    total = total if inf else total.pow(1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"clip_grad_norm_: the total norm of order {norm_type} is {total}; "
                           "set error_if_nonfinite=False to clip anyway")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g, _ in grads:
        g.detach().mul_(coef.to(g.device, g.dtype))
    return total
