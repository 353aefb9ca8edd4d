"""Ops that move or regroup elements without computing: ``view``/``reshape``/``flatten``/
``squeeze``, ``transpose``/``permute``, ``expand``, ``cat``/``stack``/``split``, and indexing."""

from __future__ import annotations

from typing import Any

import torch

from hyperpar.dtensor.placement import REPLICATE, Shard
from hyperpar.dtensor.rules.base import spelled_dims
from hyperpar.dtensor.rules.index import is_basic
from hyperpar.dtensor.rules.view import (
    matrix_transposed_dims,
    moved_dims,
    permuted_dims,
    transposed_dims,
)
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
    op_name,
    register_op,
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
        perm = permuted_dims(nd, spelled_dims(args[1:]) if len(args) > 1 else kwargs["dims"])
    elif func in (torch.t, torch.Tensor.t) or getattr(func, "__name__", "") == "__get__":
        # .mT, and .T beyond 2-D (deprecated in torch), swap the last two dims
        perm = matrix_transposed_dims(nd, getattr(getattr(func, "__self__", None), "__name__",
                                                  "") == "mT" or nd > 2 and
                                      func not in (torch.t, torch.Tensor.t))
    elif func in (torch.movedim, torch.Tensor.movedim):
        perm = moved_dims(nd, args[1] if len(args) > 1 else kwargs["source"],
                          args[2] if len(args) > 2 else kwargs["destination"])
    else:  # transpose / swapaxes
        perm = transposed_dims(nd, args[1] if len(args) > 1 else kwargs.get("dim0"),
                               args[2] if len(args) > 2 else kwargs.get("dim1"))
    res = decide("permute", [spec], dims=perm)  # placements follow their dims
    return perm, DTensorSpec(spec.mesh, res.outputs[0], torch.Size(res.shapes[0]))


@register_op(torch.Tensor.mH.__get__, torch.Tensor.H.__get__, torch.adjoint,
             torch.Tensor.adjoint, raw=True)
def adjoint_rule(func, args, kwargs):
    """``.mH``/``adjoint`` (and ``.H`` of a matrix): ``.mT``'s placements, conjugated when
    complex (the conjugate is elementwise: no communication)."""
    x = args[0]
    if getattr(getattr(func, "__self__", None), "__name__", "") == "H" and x.ndim != 2:
        raise ValueError(f"tensor.H is only supported on matrices (2-D tensors); got a "
                         f"{x.ndim}-D DTensor (use .mH for batches of matrices)")
    out = x.mT
    return out.conj() if out.is_complex() else out


@register_op(torch.Tensor.expand, torch.Tensor.expand_as, torch.broadcast_to)
def expand_rule(call: OpCall) -> Sharding:
    """``expand``/``broadcast_to``: the neutral rule (rules/index.py): a sharded dim that grows
    is gathered, new leading dims replicated."""
    x = call.args[0]
    spec = x._spec
    shape = tuple(infer_shapes(call.func, call.args, call.kwargs))  # torch reads the spellings
    res = decide("expand", [spec], shape=shape)
    out = res.outputs[0]
    out_spec = DTensorSpec(spec.mesh, out, torch.Size(shape))
    local_shape, _ = out_spec.local_shape_and_offset()

    def local(t, *a, **k):
        return t.expand(local_shape)

    return Sharding([res.inputs[0]] + [None] * (len(call.dtensors) - 1), out, shape,
                    local=local)


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
        sh = neutral_sharding("unbind", call, dim=call.arg(1, "dim", 0))
    else:
        if call.func in (torch.tensor_split, torch.Tensor.tensor_split):
            moved = _tensor_split_indices(call)
            if moved is not None:
                return moved
        dim = call.arg(2, "dim", 0)
        shapes = infer_shapes(call.func, call.args, call.kwargs)  # the many spellings
        d = dim % x.ndim
        sh = neutral_sharding("split", call, dim=dim, sizes=[s[d] for s in shapes])
    if not isinstance(sh.outputs, list):  # one piece: still a tuple of outputs
        sh.outputs, sh.shapes = [sh.outputs], [sh.shapes]
    return sh


def _tensor_split_indices(call: OpCall) -> Any:
    """``tensor_split`` given its indices or sections as a tensor (plain or DTensor): the call
    again with them as Python ints (a plan is cached by argument values, and a tensor's values
    are not part of its key; torch reads them on the CPU, not on meta tensors). None when they
    are not a tensor."""
    args = list(call.args)
    key = "tensor_indices_or_sections"
    where = 1 if len(args) > 1 else next((k for k in (key, "indices", "sections")
                                          if k in call.kwargs), None)
    if where is None:
        return None
    ind = args[1] if where == 1 else call.kwargs[where]
    if isinstance(ind, DTensor):  # its whole value, the same on every rank
        ind = replicated_local(ind).detach()
    if not isinstance(ind, torch.Tensor):
        return None
    if ind.dtype != torch.int64 or ind.ndim > 1:
        raise ShardingError(
            f"{op_name(call.func)}: tensor_indices_or_sections must be a 0-d or 1-d int64 "
            f"tensor, got {ind.dtype} of shape {tuple(ind.shape)}")
    value = ind.tolist()
    kwargs = dict(call.kwargs)
    if where == 1:
        args[1] = value
    else:
        del kwargs[where]
        kwargs["sections" if isinstance(value, int) else "indices"] = value
    return call.func(*args, **kwargs)


# ---------------------------------------------------------------------------- indexing
_GETITEM = "getitem"  # key prefix in the shared plan cache


def _plain(v: Any) -> bool:
    return v is None or type(v) is int


def _index_key(items: tuple) -> tuple | None:
    """Cache key of a basic index (slices are unhashable before Python 3.12), or None when a
    bound is not a plain int (a tensor would be keyed by identity, not value)."""
    key = []
    for i in items:
        if type(i) is slice:
            if not (_plain(i.start) and _plain(i.stop) and _plain(i.step)):
                return None
            key.append((slice, i.start, i.stop, i.step))
        elif i is Ellipsis or _plain(i):
            key.append(i)
        else:
            return None
    return tuple(key)


@register_op(torch.Tensor.__getitem__, raw=True)
def getitem_rule(func, args, kwargs):
    """``x[...]``: basic indexing gathers the indexed dims only (the neutral rule,
    rules/index.py); advanced indexing gathers all."""
    x, index = args[0], args[1]
    spec = x._spec
    items = index if type(index) is tuple else (index,)
    if not all(map(is_basic, items)):
        if any(isinstance(i, DTensor) for i in items):
            raise ShardingError("indexing a DTensor with a DTensor index is not supported")
        local = replicated_local(x)
        out = local[index]
        # advanced indexing copies in torch too: an in-place op on it is torch's semantics
        return _wrap(out, DTensorSpec(spec.mesh, (R,) * spec.mesh.ndim, out.shape))
    # traced: plan afresh (a constant of the graph), no cache
    ikey = None if _is_compiling() else _index_key(items)
    key = None if ikey is None else (_GETITEM, spec, ikey)
    plan = None if key is None else PLAN_CACHE.get(key)
    if plan is None:
        res = decide("getitem", [spec], index=items)
        pl = res.inputs[0]
        plan = (pl, DTensorSpec(spec.mesh, res.outputs[0], torch.Size(res.shapes[0])),
                None if pl == spec.placements else pl)
        if key is not None:
            PLAN_CACHE.put(key, plan)
    pl, out_spec, gathered = plan
    out_local = localize(x, pl, None, False)[index]
    return _note_copy(_wrap(out_local, out_spec), x, gathered, func, index)


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
