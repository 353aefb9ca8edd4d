"""Ops that move or regroup elements without computing: ``view``/``reshape``/``flatten``/
``squeeze``, ``transpose``/``permute``, ``expand``, ``cat``/``stack``/``split``, and indexing."""

from __future__ import annotations

from typing import Any

import torch

from hyperpar.dtensor.placement import REPLICATE, Shard
from hyperpar.torch.dtensor._ops.dispatch import (
    PLAN_CACHE,
    Unhashable,
    args_key,
    copy_note,
    infer_shapes,
    key_of,
    localize,
    mark_copy,
    replicated_local,
)
from hyperpar.torch.dtensor._ops.neutral import decide, neutral_sharding
from hyperpar.torch.dtensor._ops.registry import (
    OpCall,
    Placements,
    Sharding,
    ShardingError,
    mixing_error,
    register_op,
    unshard,
)
from hyperpar.torch.dtensor.api import DTensor, DTensorSpec, _wrap

R = REPLICATE


# ---------------------------------------------------------------------------- views
_is_compiling = torch.compiler.is_compiling
_VIEW, _PERM = "view", "permute"  # key prefixes in the shared plan cache


def _view_plan(func, args, kwargs) -> tuple:
    x = args[0]
    spec = x._spec
    try:
        key = (_VIEW, func, spec, args_key(args[1:]), key_of(tuple(kwargs.items())))
        # traced: plan afresh (a constant of the graph), no cache
        plan = None if _is_compiling() else PLAN_CACHE.get(key)
    except Unhashable:
        key, plan = None, None
    if plan is None:
        dst = infer_shapes(func, args, kwargs)
        res = decide("reshape", [spec], shape=tuple(dst))  # the neutral rule (rules/view.py)
        tg, out = res.inputs[0], res.outputs[0]
        out_spec = DTensorSpec(spec.mesh, out, torch.Size(dst))
        local_shape, _ = out_spec.local_shape_and_offset()
        plan = (None if tg == spec.placements else tg, out, out_spec, local_shape)
        if key is not None and not _is_compiling():
            PLAN_CACHE.put(key, plan)
    return plan


@register_op(torch.Tensor.view, torch.reshape, torch.Tensor.reshape, torch.flatten,
             torch.Tensor.flatten, torch.unflatten, torch.Tensor.unflatten, torch.squeeze,
             torch.Tensor.squeeze, torch.unsqueeze, torch.Tensor.unsqueeze,
             torch.Tensor.view_as, torch.Tensor.reshape_as, raw=True)
def view_rule(func, args, kwargs):
    """``view``/``reshape``/``flatten``/``squeeze``...: shards kept where the dim maps, else
    gathered."""
    x = args[0]
    if not isinstance(x, DTensor):
        raise mixing_error(func, x)
    tg, out, out_spec, local_shape = _view_plan(func, args, kwargs)
    local = x._local if tg is None and not x._local.requires_grad else \
        localize(x, tg, out, True)
    if func is torch.Tensor.view and tg is None:
        result = _wrap(local.view(local_shape), out_spec)
    else:
        result = _wrap(local.reshape(local_shape), out_spec)
    return _note_copy(result, x, tg, func)


@register_op(torch.Tensor.permute, torch.permute, torch.t, torch.Tensor.t, torch.transpose,
             torch.Tensor.transpose, torch.swapaxes, torch.Tensor.swapaxes, torch.movedim,
             torch.Tensor.movedim, torch.Tensor.T.__get__, torch.Tensor.mT.__get__, raw=True)
def permute_rule(func, args, kwargs):
    """``transpose``/``permute``/``t``/``movedim``/``.T``/``.mT``: placements permuted, no
    communication."""
    x = args[0]
    spec = x._spec
    try:
        key = (_PERM, func, spec, args_key(args[1:]), key_of(tuple(kwargs.items())))
        # traced: plan afresh (a constant of the graph), no cache
        plan = None if _is_compiling() else PLAN_CACHE.get(key)
    except Unhashable:
        key, plan = None, None
    if plan is None:
        plan = _permute_plan(func, args, kwargs)
        if key is not None and not _is_compiling():
            PLAN_CACHE.put(key, plan)
    perm, out_spec = plan
    return _note_copy(_wrap(x._local.permute(perm) if perm else x._local, out_spec), x, None,
                      func)


def _permute_plan(func, args, kwargs):
    x = args[0]
    spec = x._spec
    nd = len(spec.shape)
    if func in (torch.Tensor.permute, torch.permute):
        dims = args[1:] if len(args) > 2 or (len(args) == 2 and isinstance(args[1], int)) \
            else tuple(args[1] if len(args) > 1 else kwargs["dims"])
        perm = [d % nd for d in dims]
    elif func in (torch.t, torch.Tensor.t) or getattr(func, "__name__", "") == "__get__":
        perm = list(range(nd))[::-1] if nd >= 2 else [0] * nd
        if getattr(getattr(func, "__self__", None), "__name__", "") == "mT" or nd > 2 and \
                func not in (torch.t, torch.Tensor.t):
            perm = list(range(nd - 2)) + [nd - 1, nd - 2]
        if nd < 2:
            perm = list(range(nd))
    elif func in (torch.movedim, torch.Tensor.movedim):
        src = args[1] if len(args) > 1 else kwargs["source"]
        dst = args[2] if len(args) > 2 else kwargs["destination"]
        src = [src] if isinstance(src, int) else list(src)
        dst = [dst] if isinstance(dst, int) else list(dst)
        src = [s % nd for s in src]
        dst = [d % nd for d in dst]
        perm = [-1] * nd
        for s, d in zip(src, dst, strict=False):
            perm[d] = s
        rest = iter(d for d in range(nd) if d not in src)
        perm = [p if p >= 0 else next(rest) for p in perm]
    else:  # transpose / swapaxes
        d0 = args[1] if len(args) > 1 else kwargs.get("dim0")
        d1 = args[2] if len(args) > 2 else kwargs.get("dim1")
        perm = list(range(nd))
        if nd:
            d0, d1 = d0 % nd, d1 % nd
            perm[d0], perm[d1] = perm[d1], perm[d0]
    res = decide("permute", [spec], dims=perm)  # placements follow their dims
    return perm, DTensorSpec(spec.mesh, res.outputs[0], torch.Size(res.shapes[0]))


@register_op(torch.Tensor.expand, torch.Tensor.expand_as, torch.broadcast_to)
def expand_rule(call: OpCall) -> Sharding:
    """``expand``/``broadcast_to``: expanded dims must be replicated."""
    x = call.args[0]
    spec = x._spec
    shape = tuple(infer_shapes(call.func, call.args, call.kwargs))
    lead = len(shape) - len(spec.shape)
    pl = tuple(R if type(p) is Shard and spec.shape[p.dim] != shape[p.dim + lead] else p
               for p in spec.placements)
    out = tuple(Shard(p.dim + lead) if type(p) is Shard else p for p in pl)
    out_spec = DTensorSpec(spec.mesh, out, torch.Size(shape))
    local_shape, _ = out_spec.local_shape_and_offset()

    def local(t, *a, **k):
        return t.expand(local_shape)

    return Sharding([pl] + [None] * (len(call.dtensors) - 1), out, shape, local=local)


# ---------------------------------------------------------------------------- cat / split
@register_op(torch.cat, torch.concat, torch.concatenate, torch.stack)
def cat_rule(call: OpCall) -> Sharding:
    """``cat``/``stack``: the neutral rule (rules/cat.py): the cat dim gathered, other shards
    kept."""
    tensors = call.arg(0, "tensors")
    for t in tensors:
        if not isinstance(t, DTensor):
            raise mixing_error(call.func, t)
    op = "stack" if call.func is torch.stack else "cat"
    return neutral_sharding(op, call, dim=call.arg(1, "dim", 0))


@register_op(torch.split, torch.Tensor.split, torch.chunk, torch.Tensor.chunk,
             torch.unbind, torch.Tensor.unbind, torch.split_with_sizes,
             torch.Tensor.split_with_sizes, torch.tensor_split, torch.Tensor.tensor_split)
def split_rule(call: OpCall) -> Sharding:
    """``split``/``chunk``/``unbind``/``tensor_split``: the neutral rule (rules/cat.py): the
    split dim gathered, others kept."""
    x = call.args[0]
    if call.func in (torch.unbind, torch.Tensor.unbind):
        return neutral_sharding("unbind", call, dim=call.arg(1, "dim", 0))
    dim = call.arg(2, "dim", 0)
    shapes = infer_shapes(call.func, call.args, call.kwargs)  # torch reads the many spellings
    d = dim % x.ndim
    return neutral_sharding("split", call, dim=dim, sizes=[s[d] for s in shapes])


# ---------------------------------------------------------------------------- indexing
@register_op(torch.Tensor.__getitem__, raw=True)
def getitem_rule(func, args, kwargs):
    """``x[...]``: basic indexing gathers the indexed dims only; advanced indexing gathers all."""
    x, index = args[0], args[1]
    spec = x._spec
    items = index if isinstance(index, tuple) else (index,)
    simple = all(i is None or i is Ellipsis or isinstance(i, int | slice) for i in items)
    if not simple:
        if any(isinstance(i, DTensor) for i in items):
            raise ShardingError("indexing a DTensor with a DTensor index is not supported")
        local = replicated_local(x)
        out = local[index]
        # advanced indexing copies in torch too: an in-place op on it is torch's semantics
        return _wrap(out, DTensorSpec(spec.mesh, (R,) * spec.mesh.ndim, out.shape))
    # map input dims to output dims and find the dims the index touches
    n_real = sum(1 for i in items if i is not None and i is not Ellipsis)
    expanded: list[Any] = []
    for i in items:
        if i is Ellipsis:
            expanded.extend([slice(None)] * (x.ndim - n_real))
        else:
            expanded.append(i)
    touched, dim_map = set(), {}
    d_in = d_out = 0
    for i in expanded:
        if i is None:
            d_out += 1
            continue
        if isinstance(i, int):
            touched.add(d_in)
            d_in += 1
            continue
        if i != slice(None):
            touched.add(d_in)
        dim_map[d_in] = d_out
        d_in += 1
        d_out += 1
    for d in range(d_in, x.ndim):
        dim_map[d] = d_out
        d_out += 1
    pl = unshard(spec.placements, touched, partial_ok=True)
    local = localize(x, pl, None, False)
    out_local = local[index]
    out_pl = tuple(Shard(dim_map[p.dim]) if type(p) is Shard else p for p in pl)
    shape = infer_shapes(func, args, kwargs)
    result = _wrap(out_local, DTensorSpec(spec.mesh, out_pl, torch.Size(shape)))
    return _note_copy(result, x, None if pl == spec.placements else pl, func, index)


def _note_copy(out: DTensor, x: DTensor, gathered_to: Placements | None, func: Any,
               index: Any = None) -> DTensor:
    """Mark ``out`` as a copy (not a view) of ``x`` when making it gathered a sharded dim, or
    when ``x`` itself is such a copy, so an in-place op on it raises (see dispatch.py)."""
    parent = copy_note(x)
    if gathered_to is None and parent is None:
        return out
    if parent is not None:
        return mark_copy(out, parent)
    dims = sorted({p.dim for p, t in zip(x._spec.placements, gathered_to, strict=True)
                   if type(p) is Shard and t != p})
    what = (f"x[{_index_text(index)}]" if index is not None
            else f"x.{getattr(func, '__name__', 'view')}(...)")
    return mark_copy(out, f"{what} of a DTensor sharded on dim {', '.join(map(str, dims))} "
                          f"(placements {x._spec.placements})")


def _index_text(index: Any) -> str:
    items = index if isinstance(index, tuple) else (index,)

    def one(i: Any) -> str:
        if isinstance(i, slice):
            return ":".join("" if v is None else str(v) for v in (i.start, i.stop)) + \
                (f":{i.step}" if i.step is not None else "")
        return "..." if i is Ellipsis else str(i)

    return ", ".join(one(i) for i in items)
