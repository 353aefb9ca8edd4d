"""Reductions: ``sum``/``mean`` (sharded dims become ``Partial("sum")``), ``amax``/``amin``
(``Partial("max"/"min")``), ``vector_norm`` (partial sums of ``|x|^p``), and the reductions that
gather the reduced dims first."""

from __future__ import annotations

import torch

from hyperpar.dtensor.placement import Shard
from hyperpar.dtensor.rules.reduction import reduced_dims, reduced_placements, reduced_shape
from hyperpar.torch.dtensor._ops.dispatch import infer_shapes, localize
from hyperpar.torch.dtensor._ops.neutral import decide, neutral_sharding, to_sharding
from hyperpar.torch.dtensor._ops.pointwise import pointwise_sharding
from hyperpar.torch.dtensor._ops.registry import (
    OpCall,
    Sharding,
    register_op,
    unshard,
)
from hyperpar.torch.dtensor.api import DTensorSpec, _wrap
from hyperpar.torch.dtensor.redistribute import redistribute_autograd


# ---------------------------------------------------------------------------- reductions
@register_op(torch.sum, torch.Tensor.sum, torch.mean, torch.Tensor.mean)
def sum_mean_rule(call: OpCall) -> Sharding:
    """``sum``/``mean``: the neutral rule (sharded reduced dims give Partial(sum); ``mean``
    divides a local sum by the global count)."""
    x = call.args[0]
    dim = call.arg(1, "dim")
    keepdim = bool(call.arg(2, "keepdim", False))
    op = "mean" if call.func in (torch.mean, torch.Tensor.mean) else "sum"
    res = decide(op, [x._spec], dim=dim, keepdim=keepdim)
    sh = to_sharding(res)
    count = res.divide_by
    if count is not None:
        dims = reduced_dims(dim, x.ndim)
        dtype = call.kwargs.get("dtype")

        def local(t, *a, **k):  # mean over sharded dims: local sum / global count
            return torch.sum(t, dims, keepdim, dtype=dtype) / count
        sh.local = local
    elif dim is None and len(call.args) < 2 and not call.kwargs:
        def local(t, *a, **k):
            return call.func(t)
        sh.local = local
    return sh


@register_op(torch.amax, torch.Tensor.amax, torch.amin, torch.Tensor.amin)
def amax_rule(call: OpCall) -> Sharding:
    """``amax``/``amin``: the neutral ``max``/``min`` rule; Partial(max/min) without grad, with
    grad the reduced dims gathered."""
    x = call.args[0]
    op = "max" if call.func in (torch.amax, torch.Tensor.amax) else "min"
    # the gradient of a Partial(max) term is not the replicated gradient: only the rank
    # holding the maximum may receive it, so differentiable maxima gather first
    pending = not (x.requires_grad and torch.is_grad_enabled())
    return neutral_sharding(op, call, dim=call.arg(1, "dim"),
                            keepdim=bool(call.arg(2, "keepdim", False)), pending=pending)


@register_op(torch.max, torch.Tensor.max, torch.min, torch.Tensor.min)
def max_rule(call: OpCall) -> Sharding:
    """``max``/``min``: elementwise with a tensor; over a dim the neutral ``max_dim``/``min_dim``
    rule (the reduced dim gathered first); whole-tensor maxima gathered."""
    other = call.arg(1, "other") if not isinstance(call.arg(1, "dim"), int) else None
    if isinstance(other, torch.Tensor):
        return pointwise_sharding(call)
    x = call.args[0]
    dim = call.arg(1, "dim")
    if dim is None:  # full reduction -> one value
        pl = unshard(x._spec.placements, range(x.ndim))
        return Sharding([pl], pl, ())
    name = "min_dim" if call.func in (torch.min, torch.Tensor.min) else "max_dim"
    return neutral_sharding(name, call, dim=dim, keepdim=bool(call.arg(2, "keepdim", False)))


#: torch functions -> the neutral op of the gathered reductions
_GATHERED = {
    **dict.fromkeys((torch.prod, torch.Tensor.prod), "prod"),
    **dict.fromkeys((torch.var, torch.Tensor.var), "var"),
    **dict.fromkeys((torch.std, torch.Tensor.std), "std"),
    **dict.fromkeys((torch.norm, torch.Tensor.norm), "norm"),
    **dict.fromkeys((torch.argmax, torch.Tensor.argmax), "argmax"),
    **dict.fromkeys((torch.argmin, torch.Tensor.argmin), "argmin"),
    **dict.fromkeys((torch.all, torch.Tensor.all), "all"),
    **dict.fromkeys((torch.any, torch.Tensor.any), "any"),
    **dict.fromkeys((torch.logsumexp, torch.Tensor.logsumexp), "logsumexp"),
    torch.var_mean: "var_mean", torch.std_mean: "std_mean",
}


@register_op(*_GATHERED)
def gathered_reduction_rule(call: OpCall) -> Sharding:
    """``prod``/``var``/``std``/``norm``/``argmax``/``any``/``logsumexp``...: the neutral
    gathered-reduction rule (reduced dims gathered first). ``keepdim`` is read off the output
    shape torch infers (its position differs between these functions)."""
    x = call.args[0]
    dim = call.arg(2 if call.func in (torch.norm, torch.Tensor.norm) else 1, "dim")
    if isinstance(dim, bool):  # var(x, True): the unbiased flag, not a dim
        dim = None
    shapes = infer_shapes(call.func, call.args, call.kwargs)
    first = shapes[0] if isinstance(shapes, list) else shapes
    res = decide(_GATHERED[call.func], [x._spec], dim=dim, keepdim=len(first) == x.ndim)
    sh = to_sharding(res)
    sh.shapes = shapes  # torch's own (equal to the rule's)
    return sh


@register_op(torch.cumsum, torch.Tensor.cumsum, torch.cumprod, torch.Tensor.cumprod)
def scan_rule(call: OpCall) -> Sharding:
    """``cumsum``/``cumprod``: the neutral scan rule (the dim gathered)."""
    op = "cumprod" if call.func in (torch.cumprod, torch.Tensor.cumprod) else "cumsum"
    return neutral_sharding(op, call, dim=call.arg(1, "dim"))


# ---------------------------------------------------------------------------- vector norm
@register_op(torch.linalg.vector_norm, raw=True)
def _vector_norm(func, args, kwargs):
    """``linalg.vector_norm``: local sums of ``|x|^p`` reduced as Partial(sum), then the root."""
    x = args[0]
    ord_ = args[1] if len(args) > 1 else kwargs.get("ord", 2)
    dim = args[2] if len(args) > 2 else kwargs.get("dim")
    keepdim = args[3] if len(args) > 3 else kwargs.get("keepdim", False)
    dtype = kwargs.get("dtype")
    spec = x._spec
    dims = reduced_dims(dim, x.ndim)  # as torch: None, [] and () are every dim
    pl = unshard(spec.placements)  # a norm of a pending sum needs the sum first
    if ord_ in (float("inf"), float("-inf"), 0) or isinstance(ord_, torch.Tensor):
        pl = unshard(pl, dims)
    local = localize(x, pl, None, False)
    if dtype is not None:
        local = local.to(dtype)
    mesh = spec.mesh
    partial = [m for m, p in enumerate(pl) if type(p) is Shard and p.dim in dims]
    out_shape = reduced_shape(tuple(spec.shape), dims, bool(keepdim))
    if not partial:
        out = torch.linalg.vector_norm(local, ord_, dims, bool(keepdim))
        return _wrap(out, DTensorSpec(mesh, reduced_placements(pl, dims, bool(keepdim), "sum"),
                                      out_shape))
    powered = local.abs().pow(ord_).sum(dims, keepdim=bool(keepdim))
    src = reduced_placements(pl, dims, bool(keepdim), "sum")
    dst = unshard(src)  # the sum of the pending |x|^p terms
    total = redistribute_autograd(powered, mesh, src, dst, out_shape)
    return _wrap(total.pow(1.0 / ord_), DTensorSpec(mesh, dst, out_shape))
