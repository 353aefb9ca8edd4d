"""Foreach and fused optimizer ops on lists of DTensors (``torch._foreach_*``,
``torch._fused_adam(w)_`` / ``_fused_sgd_`` / ``_fused_adagrad_``): what
``torch.optim.AdamW`` (default foreach, or ``fused=True``) and
``clip_grad_norm_(foreach=True)`` call.

Each op works element by element on its lists, so entry ``i`` of every list must share one
layout (a parameter, its gradient and its optimizer state do); the op then runs once on the
local shards. ``_foreach_norm`` is the exception: a sharded tensor's norm combines its shards'
norms (one all-reduce per mesh dim for all the tensors that share a layout).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from hyperpar.dtensor.placement import REPLICATE, Partial, Replicate, Shard
from hyperpar.platform import get_platform
from hyperpar.torch.dtensor._ops.registry import ShardingError, op_name, register_op
from hyperpar.torch.dtensor.api import DTensor, DTensorSpec, _wrap

_FOREACH = [getattr(torch, n) for n in dir(torch)
            if n.startswith("_foreach_") and n not in ("_foreach_norm", "_foreach_max")]
_FUSED = [getattr(torch, n, None) for n in ("_fused_adam_", "_fused_adamw_", "_fused_sgd_",
                                             "_fused_adagrad_")]


def _is_list(a: Any) -> bool:
    return type(a) in (list, tuple) and any(isinstance(b, torch.Tensor) for b in a)


def _check_lists(func: Any, args: Sequence, kwargs: dict) -> list[DTensorSpec | None]:
    """The layout of each list position (``None`` where no list holds a DTensor there), after
    checking that DTensors at one position agree and none is Partial. Raised on every rank
    alike (it depends only on the layouts) before anything runs."""
    specs: list[DTensorSpec | None] = []
    name = op_name(func)
    for a in list(args) + list(kwargs.values()):
        if not _is_list(a):
            continue
        if len(specs) < len(a):
            specs.extend([None] * (len(a) - len(specs)))
        for i, t in enumerate(a):
            if isinstance(t, DTensor):
                s = t._spec
                if any(type(p) is Partial for p in s.placements):
                    raise ShardingError(
                        f"{name}: entry {i} is a Partial DTensor ({s.placements}); foreach ops "
                        f"need reduced values: redistribute it to Replicate/Shard first")
                seen = specs[i]
                if seen is None:
                    specs[i] = s
                elif seen is not s and (seen.mesh != s.mesh or seen.placements != s.placements
                                        or seen.shape != s.shape):
                    raise ShardingError(
                        f"{name}: entry {i} of its tensor lists has two layouts, {seen} and "
                        f"{s}; a parameter, its gradient and its state must share one layout "
                        f"(redistribute the odd one, e.g. the gradient, to the parameter's)")
            elif isinstance(t, torch.Tensor) and t.dim() > 0 and specs[i] is not None:
                raise ShardingError(
                    f"{name}: entry {i} mixes a DTensor and a plain {tuple(t.shape)} tensor; "
                    f"make both DTensors (distribute_tensor) or both plain (to_local())")
    return specs


def _local(a: Any, func: Any) -> Any:
    if isinstance(a, DTensor):
        # a lone tensor argument (clip coefficient, learning rate): a scalar for every entry
        if any(type(p) is not Replicate for p in a._spec.placements):
            raise ShardingError(
                f"{op_name(func)}: a single DTensor argument is applied to every list entry, "
                f"so it must be Replicate; got {a._spec.placements} (use .full_tensor())")
        return a._local
    if type(a) in (list, tuple):
        return type(a)(b._local if isinstance(b, DTensor) else b for b in a)
    return a


@register_op(_FOREACH, _FUSED, raw=True)
def foreach_rule(func: Any, args: Sequence, kwargs: dict) -> Any:
    """Elementwise over lists: entry ``i`` of every list shares one layout (Shard/Replicate);
    runs on the local shards, outputs keep entry ``i``'s layout."""
    specs = _check_lists(func, args, kwargs)
    out = func(*[_local(a, func) for a in args], **{k: _local(v, func) for k, v in kwargs.items()})
    if out is None or not _is_list(out):
        return out
    if func.__name__.endswith("_"):  # in place: torch returns the (updated) first list itself
        first = next(a for a in args if _is_list(a))
        return list(first)
    return [_wrap(o, specs[i]) if specs[i] is not None and isinstance(o, torch.Tensor) else o
            for i, o in enumerate(out)]


@register_op(torch._foreach_norm, raw=True)
def foreach_norm(func: Any, args: Sequence, kwargs: dict) -> Any:
    """``_foreach_norm(tensors, ord)``: each DTensor's norm over its whole logical value,
    Replicate; shards' norms combine with one all-reduce per mesh dim and layout group."""
    tensors = args[0]
    ord_ = args[1] if len(args) > 1 else kwargs.get("ord", 2)
    dtype = args[2] if len(args) > 2 else kwargs.get("dtype")
    specs = _check_lists(func, (tensors,), {})
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise NotImplementedError(
            "torch._foreach_norm on DTensors that require grad is not differentiable in "
            "hyperpar; call it under torch.no_grad() (as clip_grad_norm_ does) or use "
            "torch.linalg.vector_norm on each DTensor")
    p = float(ord_)
    local = func([t._local if isinstance(t, DTensor) else t for t in tensors], ord_,
                 **({"dtype": dtype} if dtype is not None else {}))
    # group entries by (mesh, sharded mesh dims): one collective per dim per group
    groups: dict[tuple, list[int]] = {}
    for i, s in enumerate(specs):
        if s is None:
            continue
        dims = tuple(m for m, pl in enumerate(s.placements)
                     if type(pl) is Shard and s.mesh.shape[m] > 1)
        groups.setdefault((s.mesh, dims), []).append(i)
    out = list(local)
    platform = get_platform()
    for (mesh, dims), idx in groups.items():
        vals = torch.stack([local[i] for i in idx])
        if dims:
            if math.isinf(p):
                for m in dims:
                    platform.all_reduce(vals, "max" if p > 0 else "min", mesh.get_group(m))
            else:
                acc = vals.double()
                acc = acc if p == 0 else acc.pow(p)  # ord 0 counts nonzeros: a plain sum
                for m in dims:
                    platform.all_reduce(acc, "sum", mesh.get_group(m))
                vals = (acc if p == 0 else acc.pow(1.0 / p)).to(vals.dtype)
        for k, i in enumerate(idx):
            out[i] = _wrap(vals[k].clone(), DTensorSpec(mesh, (REPLICATE,) * mesh.ndim, ()))
    return out
