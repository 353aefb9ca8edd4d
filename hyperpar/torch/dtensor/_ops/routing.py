"""MoE routing and expert ops on DTensors: torch's ``topk``/``sort``/``argsort``, ``histc``,
``bincount``, ``scatter``/``scatter_``/``scatter_add``, ``index_add`` and ``_grouped_mm``
mapped onto the neutral rules of :mod:`hyperpar.dtensor.rules.routing`."""

from __future__ import annotations

from typing import Any

import torch

from hyperpar.dtensor.placement import Replicate
from hyperpar.dtensor.rules.base import ShardingError
from hyperpar.torch.dtensor._ops.neutral import decide, to_sharding
from hyperpar.torch.dtensor._ops.registry import (
    OpCall,
    Sharding,
    mixing_error,
    op_name,
    register_op,
)
from hyperpar.torch.dtensor.api import DTensor


def _all_dtensors(call: OpCall, tensors: list[Any]) -> None:
    for t in tensors:
        if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) and t.ndim > 0:
            raise mixing_error(call.func, t)


@register_op(torch.topk, torch.Tensor.topk)
def topk_rule(call: OpCall) -> Sharding:
    """``topk(x, k, dim)`` (``sorted`` either way): the dim gathered, other shards kept."""
    x = call.args[0]
    return to_sharding(decide("sort_along", [x._spec], dim=call.arg(2, "dim", -1),
                              k=call.arg(1, "k")))


@register_op(torch.sort, torch.Tensor.sort, torch.argsort, torch.Tensor.argsort)
def sort_rule(call: OpCall) -> Sharding:
    """``sort`` / ``argsort`` along ``dim``: the dim gathered, other shards kept."""
    x = call.args[0]
    dim = call.arg(1, "dim", -1)
    if isinstance(dim, bool):  # sort(x, stable) overload: the flag, not a dim
        dim = call.kwargs.get("dim", -1)
    outputs = 1 if call.func in (torch.argsort, torch.Tensor.argsort) else 2
    return to_sharding(decide("sort_along", [x._spec], dim=dim, outputs=outputs))


@register_op(torch.histc, torch.Tensor.histc)
def histc_rule(call: OpCall) -> Sharding:
    """``histc(x, bins, min, max)``: local counts of a shard as ``Partial("sum")``; a range
    taken from the data (``min == max``) gathers first."""
    x = call.args[0]
    bins = call.arg(1, "bins", 100)
    lo, hi = call.arg(2, "min", 0), call.arg(3, "max", 0)
    return to_sharding(decide("histogram", [x._spec], bins=bins, data_range=lo == hi))


@register_op(torch.bincount, torch.Tensor.bincount, raw=True)
def bincount_rule(func: Any, args: Any, kwargs: Any) -> Any:
    """``bincount``: its length depends on the values, so the input (and weights) are
    gathered; the counts are replicated."""
    x = args[0]
    weights = args[1] if len(args) > 1 else kwargs.get("weights")
    minlength = args[2] if len(args) > 2 else kwargs.get("minlength", 0)
    if not isinstance(x, DTensor) or (weights is not None and not isinstance(weights, DTensor)):
        raise mixing_error(func, weights if isinstance(x, DTensor) else x)
    mesh = x.device_mesh
    full_w = None if weights is None else weights.full_tensor()
    out = torch.bincount(x.full_tensor(), full_w, minlength)
    return DTensor.from_local(out, mesh, [Replicate()] * mesh.ndim, run_check=False)


_SCATTER_INPLACE = (torch.Tensor.scatter_, torch.Tensor.scatter_add_)


@register_op(torch.scatter, torch.Tensor.scatter, torch.Tensor.scatter_,
             torch.scatter_add, torch.Tensor.scatter_add, torch.Tensor.scatter_add_)
def scatter_rule(call: OpCall) -> Sharding:
    """``scatter(dim, index, src | value)`` / ``scatter_add``: other dims shard together
    (self, index, src alike), the scatter dim whole; in place only where ``self`` keeps its
    layout."""
    x = call.args[0]
    dim = call.arg(1, "dim")
    index = call.arg(2, "index")
    src = call.arg(3, "src", call.kwargs.get("value"))
    _all_dtensors(call, [index, src])
    tensors = [x, index] + ([src] if isinstance(src, DTensor) else [])
    res = decide("scatter_d", [t._spec for t in tensors], dim=dim)
    if call.func in _SCATTER_INPLACE and res.inputs[0] != tuple(x.placements):
        raise ShardingError(
            f"{op_name(call.func)} in place on a DTensor with placements {x.placements} "
            f"(index {index.placements}, dim={dim}): it would write into a gathered copy. "
            "Shard self, index and src alike on a dim other than the scatter dim, or "
            "redistribute self to Replicate first (or use the out-of-place scatter)")
    sh = to_sharding(res)
    sh.inputs = [res.inputs[[i for i, t in enumerate(tensors) if t is d][0]]
                 if any(t is d for t in tensors) else None for d in call.dtensors]
    return sh


@register_op(torch.index_add, torch.Tensor.index_add)
def index_add_rule(call: OpCall) -> Sharding:
    """``index_add(dim, index, source)``: ``dim`` whole, ``index`` replicated, other dims
    of self and source shard together."""
    x = call.args[0]
    dim, index, source = call.arg(1, "dim"), call.arg(2, "index"), call.arg(3, "source")
    _all_dtensors(call, [index, source])
    if not isinstance(index, DTensor) or not isinstance(source, DTensor):
        raise mixing_error(call.func, index if not isinstance(index, DTensor) else source)
    return to_sharding(decide("index_add", [x._spec, index._spec, source._spec], dim=dim))


_GROUPED_MM = getattr(torch, "_grouped_mm", None)


if _GROUPED_MM is not None:
    @register_op(_GROUPED_MM)
    def grouped_mm_rule(call: OpCall) -> Sharding:
        """``_grouped_mm(a, b, offs)``: expert weights sharded on N give an output sharded on
        its last dim, on K (with ``a``) a Partial sum; token/expert dims gathered."""
        a, b = call.args[0], call.arg(1, "mat_b")
        offs = call.arg(2, "offs")
        _all_dtensors(call, [a, b, offs])
        if not isinstance(offs, DTensor) or call.kwargs.get("bias") is not None:
            raise ShardingError(
                f"{op_name(call.func)} on DTensors needs offs as a DTensor (replicated) and "
                "no bias; call it on .to_local() per rank otherwise")
        return to_sharding(decide("grouped_mm", [a._spec, b._spec, offs._spec]))
