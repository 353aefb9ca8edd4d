"""Sharding rules for the ops a Llama-style transformer needs (all registered in
``ops.OP_TABLE`` through :func:`register_op`). Each rule is a pure function of the input
placements and shapes; see ``docs/dtensor.md`` for the table."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from hyperpar.platform import get_platform

from . import random as _random
from .api import DTensor, DTensorSpec, _wrap
from .ops import (
    _P_SUM,
    OpCall,
    Placements,
    Sharding,
    ShardingError,
    _args_key,
    _key_of,
    _localize,
    _mixing_error,
    _name,
    _Unhashable,
    infer_shapes,
    register_handler,
    register_op,
)
from .placement import REPLICATE, Partial, Placement, Replicate, Shard, chunk_bounds
from .redistribute import redistribute_autograd

R = REPLICATE


# ---------------------------------------------------------------------------- helpers
def unshard(placements: Placements, dims: Sequence[int] = (), *, partial_ok: bool = False
            ) -> Placements:
    """``placements`` with tensor ``dims`` un-sharded and (unless ``partial_ok``) Partial
    replaced by Replicate."""
    return tuple(
        R if (type(p) is Shard and p.dim in dims) or (type(p) is Partial and not partial_ok)
        else p
        for p in placements
    )


def _dims_arg(dim: Any, ndim: int) -> tuple[int, ...]:
    if dim is None:
        return tuple(range(ndim))
    if isinstance(dim, int):
        dim = (dim,)
    return tuple(sorted({d % ndim if ndim else 0 for d in dim}))


def _replicated(dt: DTensor) -> torch.Tensor:
    spec = dt._spec
    return redistribute_autograd(dt._local, spec.mesh, spec.placements,
                                 (R,) * spec.mesh.ndim, tuple(spec.shape))


# ---------------------------------------------------------------------------- metadata
def _local_query(func: Any, args: Sequence, kwargs: dict) -> Any:
    return func(args[0]._local, *args[1:], **kwargs)


register_handler(torch.is_complex, torch.Tensor.is_complex, torch.is_floating_point,
                 torch.Tensor.is_floating_point, torch.Tensor.element_size,
                 torch.Tensor.get_device, torch.Tensor.is_pinned, torch.is_nonzero,
                 torch.Tensor.data_ptr, torch.Tensor.storage_offset,
                 name="local metadata")(_local_query)


@register_handler(torch.Tensor.is_contiguous, name="metadata")
def _is_contiguous(func, args, kwargs):
    return True


@register_handler(torch.Tensor.stride, name="metadata")
def _stride(func, args, kwargs):
    shape = args[0]._spec.shape
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(int(s), 1)
    strides = tuple(reversed(strides))
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    return strides if dim is None else strides[dim]


@register_handler(torch.numel, torch.Tensor.nelement, name="metadata")
def _numel(func, args, kwargs):
    return args[0]._spec.shape.numel()


@register_handler(torch.Tensor.register_hook, name="hook on the local tensor")
def _register_hook(func, args, kwargs):
    self, hook = args[0], args[1] if len(args) > 1 else kwargs["hook"]
    spec = self._spec

    def local_hook(grad):
        out = hook(_wrap(grad, DTensorSpec(spec.mesh, tuple(
            R if type(p) is Partial else p for p in spec.placements), spec.shape)))
        return None if out is None else out._local

    return self._local.register_hook(local_hook)


@register_handler(torch.Tensor.data.__get__, name="data")
def _data(func, args, kwargs):
    return _wrap(args[0]._local.data, args[0]._spec)


@register_handler(torch.detach, name="detach")
def _detach(func, args, kwargs):
    return args[0].detach()


@register_handler(torch.Tensor.contiguous, name="contiguous")
def _contiguous(func, args, kwargs):
    x = args[0]
    return _wrap(x._local.contiguous(), x._spec)


@register_handler(torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__,
                  torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.__index__,
                  torch.Tensor.numpy, name="replicate then local")
def _to_python(func, args, kwargs):
    return func(_replicated(args[0]).detach(), *args[1:], **kwargs)


# ---------------------------------------------------------------------------- *_like / new_*
def _like(fill):
    def handler(func, args, kwargs):
        x = args[0]
        kwargs = dict(kwargs)
        kwargs.pop("memory_format", None)
        spec = x._spec
        zero = fill == "zeros" or fill == "empty"
        placements = spec.placements if zero else tuple(
            R if type(p) is Partial else p for p in spec.placements)
        out_spec = spec if placements == spec.placements else DTensorSpec(spec.mesh, placements,
                                                                          spec.shape)
        local_shape, offset = out_spec.local_shape_and_offset()
        dtype = kwargs.pop("dtype", None) or x._local.dtype
        requires_grad = kwargs.pop("requires_grad", False)
        device = x._local.device
        if fill in ("rand", "randn"):
            block = _random.uniform_block if fill == "rand" else _random.normal_block
            local = block(tuple(spec.shape), local_shape, offset, dtype, device)
        elif fill == "full":
            local = torch.full(local_shape, args[1] if len(args) > 1 else kwargs["fill_value"],
                               dtype=dtype, device=device)
        else:
            local = getattr(torch, fill)(local_shape, dtype=dtype, device=device)
        return _wrap(local.requires_grad_(requires_grad), out_spec)

    return handler


for _fill in ("zeros", "ones", "empty", "full", "rand", "randn"):
    register_handler(getattr(torch, f"{_fill}_like"), name=f"{_fill}_like")(_like(_fill))


def _new(fill):
    def handler(func, args, kwargs):
        x = args[0]
        rest = args[1:]
        if fill == "full":
            size, value, rest = rest[0], rest[1] if len(rest) > 1 else kwargs.pop("fill_value"), ()
        elif len(rest) == 1 and not isinstance(rest[0], int):
            size = tuple(rest[0])
        else:
            size = tuple(rest)
        kwargs = dict(kwargs)
        kwargs.pop("size", None)
        dtype = kwargs.pop("dtype", None) or x._local.dtype
        requires_grad = kwargs.pop("requires_grad", False)
        mesh = x._spec.mesh
        if fill == "full":
            local = torch.full(size, value, dtype=dtype, device=x._local.device)
        else:
            local = getattr(torch, fill)(size, dtype=dtype, device=x._local.device)
        return _wrap(local.requires_grad_(requires_grad),
                     DTensorSpec(mesh, (R,) * mesh.ndim, torch.Size(size)))

    return handler


for _fill in ("zeros", "ones", "empty", "full"):
    register_handler(getattr(torch.Tensor, f"new_{_fill}"), name=f"new_{_fill}")(_new(_fill))


# ---------------------------------------------------------------------------- in-place init
@register_handler(torch.Tensor.copy_, name="copy_")
def _copy_(func, args, kwargs):
    dst, src = args[0], args[1]
    spec = dst._spec
    if isinstance(src, DTensor):
        local = redistribute_autograd(src._local, spec.mesh, src._spec.placements,
                                      spec.placements, tuple(src._spec.shape))
    else:
        if src.ndim and tuple(src.shape) != tuple(spec.shape):
            raise _mixing_error(func, src)
        if any(type(p) is Partial for p in spec.placements):
            raise ShardingError("copy_ of a plain tensor into a Partial DTensor")
        local = src
        if src.ndim:
            shape, offset = spec.local_shape_and_offset()
            for d, (o, n) in enumerate(zip(offset, shape, strict=False)):
                local = local.narrow(d, o, n)
    dst._local.copy_(local, *args[2:], **kwargs)
    return dst


@register_handler(torch.Tensor.zero_, torch.nn.init.zeros_, name="zero_")
def _zero_(func, args, kwargs):
    x = _init_args(args, kwargs)[0]
    x._local.zero_()
    return x


@register_handler(torch.Tensor.fill_, torch.nn.init.constant_, torch.nn.init.ones_,
                  name="fill_")
def _fill_(func, args, kwargs):
    x, rest, kwargs = _init_args(args, kwargs)
    value = 1.0 if func is torch.nn.init.ones_ else (rest[0] if rest
                                                     else kwargs.get("value", kwargs.get("val")))
    if isinstance(value, DTensor):
        value = _replicated(value)
    spec = x._spec
    x._local.fill_(value)
    coord = spec.mesh._coordinate
    for m, p in enumerate(spec.placements):
        if p == _P_SUM and coord[m] != 0:
            x._local.zero_()
    return x


def _init_args(args: Sequence, kwargs: dict) -> tuple[Any, tuple, dict]:
    """nn.init functions pass the tensor as ``tensor=``."""
    if args:
        return args[0], tuple(args[1:]), dict(kwargs)
    kwargs = dict(kwargs)
    return kwargs.pop("tensor"), (), kwargs


def _random_init(kind: str):
    def handler(func, args, kwargs):
        x, params, kwargs = _init_args(args, kwargs)
        spec = x._spec
        if any(type(p) is Partial for p in spec.placements):
            raise ShardingError(f"{_name(func)} on a Partial DTensor; redistribute it first")
        shape, offset = spec.local_shape_and_offset()
        local = x._local
        if kind == "uniform":
            a = params[0] if params else kwargs.get("a", kwargs.get("from", 0.0))
            b = params[1] if len(params) > 1 else kwargs.get("b", kwargs.get("to", 1.0))
            u = _random.uniform_block(tuple(spec.shape), shape, offset, torch.float64,
                                      local.device)
            vals = a + (b - a) * u
        else:
            mean = params[0] if params else kwargs.get("mean", 0.0)
            std = params[1] if len(params) > 1 else kwargs.get("std", 1.0)
            vals = mean + std * _random.normal_block(tuple(spec.shape), shape, offset,
                                                     torch.float64, local.device)
            if kind == "trunc_normal":
                a = params[2] if len(params) > 2 else kwargs.get("a", -2.0)
                b = params[3] if len(params) > 3 else kwargs.get("b", 2.0)
                vals = vals.clamp(a, b)
        with torch.no_grad():
            local.copy_(vals.to(local.dtype))
        return x

    return handler


register_handler(torch.Tensor.uniform_, torch.nn.init.uniform_, name="uniform_ (offset RNG)")(
    _random_init("uniform"))
register_handler(torch.Tensor.normal_, torch.nn.init.normal_, name="normal_ (offset RNG)")(
    _random_init("normal"))
register_handler(torch.nn.init.trunc_normal_, name="trunc_normal_ (offset RNG, clamped)")(
    _random_init("trunc_normal"))


# ---------------------------------------------------------------------------- matmul family
def _cost(cur: Placement, tgt: Placement, numel: int) -> float:
    if cur == tgt:
        return 0.0
    if type(cur) is Replicate:
        return 0.01 * numel if type(tgt) is Shard else 1.0 * numel
    if type(cur) is Shard:
        return 0.5 * numel if type(tgt) is Shard else 1.0 * numel
    return (1.0 if type(tgt) is Shard else 2.0) * numel  # Partial


def einsum_sharding(mesh, operands: list[tuple[Placements, str, tuple[int, ...]]], out: str,
                    blocked: str = "") -> tuple[list[Placements], Placements]:
    """Placements for a contraction given by labels (``"bmk,kn->bmn"``). Per mesh dim it picks
    the cheapest of: shard a kept label (output sharded), shard a contracted label (output
    Partial), one Partial operand with the others replicated, or everything replicated."""
    labels = sorted({c for _, lab, _ in operands for c in lab} - set(blocked))
    numels = [max(1, math.prod(shape)) for _, _, shape in operands]
    targets: list[list[Placement]] = [[] for _ in operands]
    outs: list[Placement] = []
    for m in range(mesh.ndim):
        cur = [pl[m] for pl, _, _ in operands]
        cands: list[tuple[list[Placement], Placement]] = []
        for lab in labels:
            tg = [Shard(ls.index(lab)) if lab in ls else R for _, ls, _ in operands]
            cands.append((tg, Shard(out.index(lab)) if lab in out else _P_SUM))
        for k in range(len(operands)):
            if cur[k] == _P_SUM:
                cands.append(([_P_SUM if j == k else R for j in range(len(operands))], _P_SUM))
        cands.append(([R] * len(operands), R))
        best = min(cands, key=lambda c: sum(_cost(cu, t, n)
                                            for cu, t, n in zip(cur, c[0], numels, strict=False)))
        for k, t in enumerate(best[0]):
            targets[k].append(t)
        outs.append(best[1])
    return [tuple(t) for t in targets], tuple(outs)


_LETTERS = "abcdefghij"


def _matmul_labels(sa: tuple, sb: tuple) -> tuple[str, str, str, str, tuple]:
    if len(sa) == 0 or len(sb) == 0:
        raise ShardingError("matmul of a 0-dim tensor")
    la = "k" if len(sa) == 1 else "mk"
    lb = "k" if len(sb) == 1 else "kn"
    ba, bb = sa[:-2] if len(sa) > 1 else (), sb[:-2] if len(sb) > 1 else ()
    nb = max(len(ba), len(bb))
    blocked = ""
    pa, pb, po = "", "", ""
    out_batch = []
    for i in range(nb):
        da = ba[i - (nb - len(ba))] if i >= nb - len(ba) else None
        db = bb[i - (nb - len(bb))] if i >= nb - len(bb) else None
        lab = _LETTERS[i]
        if da is not None and db is not None and da != db:
            # broadcast: the size-1 side may not be sharded on this dim
            big = lab
            small = lab.upper()
            blocked += small
            pa += big if da != 1 else small
            pb += big if db != 1 else small
        else:
            if da is not None:
                pa += lab
            if db is not None:
                pb += lab
        po += lab
        out_batch.append(max(d for d in (da, db) if d is not None))
    out = po + ("m" if len(sa) > 1 else "") + ("n" if len(sb) > 1 else "")
    shape = tuple(out_batch) + ((sa[-2],) if len(sa) > 1 else ()) + ((sb[-1],) if len(sb) > 1
                                                                      else ())
    return pa + la, pb + lb, out, blocked, shape


@register_op(torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm,
             torch.Tensor.mm, torch.bmm, torch.Tensor.bmm)
def matmul_rule(call: OpCall) -> Sharding:
    a, b = call.args[0], call.args[1]
    if not (isinstance(a, DTensor) and isinstance(b, DTensor)):
        raise _mixing_error(call.func, b if isinstance(a, DTensor) else a)
    sa, sb = tuple(a._spec.shape), tuple(b._spec.shape)
    la, lb, lo, blocked, shape = _matmul_labels(sa, sb)
    tg, out = einsum_sharding(call.mesh, [(a._spec.placements, la, sa),
                                          (b._spec.placements, lb, sb)], lo, blocked)
    return Sharding(tg, out, shape)


@register_handler(torch.Tensor.__rmatmul__, name="matmul_rule")
def _rmatmul(func, args, kwargs):
    return torch.matmul(args[1], args[0])


@register_op(F.linear)
def linear_rule(call: OpCall) -> Sharding:
    x, w = call.args[0], call.args[1]
    bias = call.arg(2, "bias")
    for t in (x, w, bias):
        if t is not None and not isinstance(t, DTensor):
            raise _mixing_error(call.func, t)
    sx, sw = tuple(x._spec.shape), tuple(w._spec.shape)
    batch = _LETTERS[:len(sx) - 1]
    tg, out = einsum_sharding(call.mesh, [(x._spec.placements, batch + "k", sx),
                                          (w._spec.placements, "nk", sw)], batch + "n")
    shape = sx[:-1] + (sw[0],)
    if bias is not None:
        bt = []
        for o in out:
            if type(o) is Shard and o.dim == len(shape) - 1:
                bt.append(Shard(0))
            elif o == _P_SUM:
                bt.append(_P_SUM)  # added once: rank 0 of the mesh dim keeps it
            else:
                bt.append(R)
        tg = tg + [tuple(bt)]
    return Sharding(tg, out, shape)


# ---------------------------------------------------------------------------- reductions
def _reduction_args(call: OpCall) -> tuple[DTensor, tuple[int, ...], bool]:
    x = call.args[0]
    dim = call.arg(1, "dim")
    keepdim = call.arg(2, "keepdim", False)
    return x, _dims_arg(dim, x.ndim), bool(keepdim)


def _reduced_placements(pl: Placements, dims: tuple[int, ...], keepdim: bool, op: str
                        ) -> Placements:
    out = []
    for p in pl:
        if type(p) is Shard:
            if p.dim in dims:
                out.append(Partial(op))
            else:
                out.append(p if keepdim else Shard(p.dim - sum(d < p.dim for d in dims)))
        else:
            out.append(p)
    return tuple(out)


def _reduced_shape(shape: tuple, dims: tuple[int, ...], keepdim: bool) -> tuple:
    return tuple((1 if keepdim else None) if d in dims else s
                 for d, s in enumerate(shape) if keepdim or d not in dims)


@register_op(torch.sum, torch.Tensor.sum, torch.mean, torch.Tensor.mean)
def sum_mean_rule(call: OpCall) -> Sharding:
    x, dims, keepdim = _reduction_args(call)
    pl = x._spec.placements
    is_mean = call.func in (torch.mean, torch.Tensor.mean)
    if any(type(p) is Partial and p.reduce_op not in ("sum", "avg") for p in pl):
        pl = unshard(pl)
    out = _reduced_placements(pl, dims, keepdim, "sum")
    shape = _reduced_shape(tuple(x._spec.shape), dims, keepdim)
    local = None
    sharded = any(type(p) is Shard and p.dim in dims for p in pl)
    if is_mean and sharded:
        count = math.prod(x._spec.shape[d] for d in dims)
        dtype = call.kwargs.get("dtype")

        def local(t, *a, **k):  # mean over sharded dims: local sum / global count
            return torch.sum(t, dims, keepdim, dtype=dtype) / count
    elif call.arg(1, "dim") is None and len(call.args) < 2 and not call.kwargs:
        def local(t, *a, **k):
            return call.func(t)
    return Sharding([pl], out, shape, local=local)


@register_op(torch.amax, torch.Tensor.amax, torch.amin, torch.Tensor.amin)
def amax_rule(call: OpCall) -> Sharding:
    x, dims, keepdim = _reduction_args(call)
    op = "max" if call.func in (torch.amax, torch.Tensor.amax) else "min"
    spec = x._spec
    if x.requires_grad and torch.is_grad_enabled():
        # the gradient of a Partial(max) term is not the replicated gradient: only the rank
        # holding the maximum may receive it, so differentiable maxima gather first
        pl = unshard(spec.placements, dims)
        return Sharding([pl], _reduced_placements(pl, dims, keepdim, op),
                        _reduced_shape(tuple(spec.shape), dims, keepdim))
    pl = tuple(p if p == Partial(op) else (R if type(p) is Partial else p)
               for p in spec.placements)
    # an empty local shard has no max: gather dims whose shards can be empty
    mesh = spec.mesh
    pl = tuple(R if type(p) is Shard and p.dim in dims and
               chunk_bounds(spec.shape[p.dim], mesh.shape[m], mesh.shape[m] - 1)[1] == 0
               else p for m, p in enumerate(pl))
    out = _reduced_placements(pl, dims, keepdim, op)
    return Sharding([pl], out, _reduced_shape(tuple(spec.shape), dims, keepdim))


@register_op(torch.max, torch.Tensor.max, torch.min, torch.Tensor.min)
def max_rule(call: OpCall) -> Sharding:
    other = call.arg(1, "other") if not isinstance(call.arg(1, "dim"), int) else None
    from .ops import pointwise_sharding

    if isinstance(other, torch.Tensor):
        return pointwise_sharding(call)
    x = call.args[0]
    dim = call.arg(1, "dim")
    if dim is None:  # full reduction -> one value
        pl = unshard(x._spec.placements, range(x.ndim))
        return Sharding([pl], pl, ())
    return _gather_reduction(call, _dims_arg(dim, x.ndim), bool(call.arg(2, "keepdim", False)))


def _gather_reduction(call: OpCall, dims: tuple[int, ...], keepdim: bool) -> Sharding:
    x = call.args[0]
    pl = unshard(x._spec.placements, dims)
    out = _reduced_placements(pl, dims, keepdim, "sum")
    shapes = infer_shapes(call.func, call.args, call.kwargs)
    if isinstance(shapes, list):
        return Sharding([pl], [out] * len(shapes), shapes)
    return Sharding([pl], out, shapes)


@register_op(torch.prod, torch.Tensor.prod, torch.var, torch.Tensor.var, torch.std,
             torch.Tensor.std, torch.norm, torch.Tensor.norm, torch.argmax, torch.Tensor.argmax,
             torch.argmin, torch.Tensor.argmin, torch.all, torch.Tensor.all, torch.any,
             torch.Tensor.any, torch.logsumexp, torch.Tensor.logsumexp, torch.cumsum,
             torch.Tensor.cumsum, torch.var_mean, torch.std_mean)
def gathered_reduction_rule(call: OpCall) -> Sharding:
    x = call.args[0]
    dim = call.arg(1, "dim")
    if call.func in (torch.norm, torch.Tensor.norm):
        dim = call.arg(2, "dim")
    if call.func in (torch.cumsum, torch.Tensor.cumsum):
        pl = unshard(x._spec.placements, _dims_arg(dim, x.ndim))
        return Sharding([pl], pl, tuple(x._spec.shape))
    keepdim = bool(call.kwargs.get("keepdim", False))
    if isinstance(dim, bool):
        dim = None
    return _gather_reduction(call, _dims_arg(dim, x.ndim), keepdim)


# ---------------------------------------------------------------------------- views
def _view_groups(src: tuple, dst: tuple) -> list[tuple[list[int], list[int]]]:
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(src) or j < len(dst):
        gs, gd = [], []
        ps = pd = 1
        if i < len(src):
            gs.append(i)
            ps = src[i]
            i += 1
        if j < len(dst):
            gd.append(j)
            pd = dst[j]
            j += 1
        while ps != pd:
            if ps < pd and i < len(src):
                gs.append(i)
                ps *= src[i]
                i += 1
            elif j < len(dst):
                gd.append(j)
                pd *= dst[j]
                j += 1
            else:
                break
        groups.append((gs, gd))
    return groups


def view_placements(mesh, src_shape: tuple, dst_shape: tuple, pl: Placements
                    ) -> tuple[Placements, Placements]:
    """(input targets, output placements) for a reshape from ``src_shape`` to ``dst_shape``."""
    if 0 in src_shape:
        pl = unshard(pl, range(len(src_shape)), partial_ok=True)
        return pl, pl
    groups = _view_groups(src_shape, dst_shape)
    where = {}
    for gs, gd in groups:
        for d in gs:
            where[d] = (gs, gd)
    factor: dict[int, int] = {}
    for m, p in enumerate(pl):
        if type(p) is Shard:
            factor[p.dim] = factor.get(p.dim, 1) * mesh.shape[m]
    tg, out = [], []
    for p in pl:
        if type(p) is not Shard:
            tg.append(p)
            out.append(p)
            continue
        gs, gd = where[p.dim]
        first_s = next((d for d in gs if src_shape[d] != 1), None)
        first_d = next((d for d in gd if dst_shape[d] != 1), None)
        n = factor[p.dim]
        ok = first_s == p.dim and first_d is not None and (
            (len([d for d in gs if src_shape[d] != 1]) == 1 and
             len([d for d in gd if dst_shape[d] != 1]) == 1)
            or (src_shape[p.dim] % n == 0 and dst_shape[first_d] % n == 0))
        if ok:
            tg.append(p)
            out.append(Shard(first_d))
        else:
            tg.append(R)
            out.append(R)
    # a tensor dim un-sharded on one mesh dim must be un-sharded on all (nesting)
    gathered = {p.dim for p, t in zip(pl, tg, strict=False) if type(p) is Shard and t is R}
    if gathered:
        tg2, out2 = [], []
        for p, t, o in zip(pl, tg, out, strict=False):
            if type(p) is Shard and p.dim in gathered:
                tg2.append(R)
                out2.append(R)
            else:
                tg2.append(t)
                out2.append(o)
        tg, out = tg2, out2
    return tuple(tg), tuple(out)


_VIEW_CACHE: dict[tuple, tuple] = {}


def _view_plan(func, args, kwargs) -> tuple:
    x = args[0]
    spec = x._spec
    try:
        key = (func, spec, _args_key(args[1:]), _key_of(tuple(kwargs.items())))
        plan = _VIEW_CACHE.get(key)
    except _Unhashable:
        key, plan = None, None
    if plan is None:
        dst = infer_shapes(func, args, kwargs)
        tg, out = view_placements(spec.mesh, tuple(spec.shape), tuple(dst), spec.placements)
        out_spec = DTensorSpec(spec.mesh, out, torch.Size(dst))
        local_shape, _ = out_spec.local_shape_and_offset()
        plan = (None if tg == spec.placements else tg, out, out_spec, local_shape)
        if key is not None:
            _VIEW_CACHE[key] = plan
    return plan


def _reshape_handler(func, args, kwargs):
    x = args[0]
    if not isinstance(x, DTensor):
        raise _mixing_error(func, x)
    tg, out, out_spec, local_shape = _view_plan(func, args, kwargs)
    local = x._local if tg is None and not x._local.requires_grad else \
        _localize(x, tg, out, True)
    if func is torch.Tensor.view and tg is None:
        return _wrap(local.view(local_shape), out_spec)
    return _wrap(local.reshape(local_shape), out_spec)


register_handler(torch.Tensor.view, torch.reshape, torch.Tensor.reshape, torch.flatten,
                 torch.Tensor.flatten, torch.unflatten, torch.Tensor.unflatten, torch.squeeze,
                 torch.Tensor.squeeze, torch.unsqueeze, torch.Tensor.unsqueeze,
                 torch.Tensor.view_as, torch.Tensor.reshape_as,
                 name="view_rule")(_reshape_handler)


_PERM_CACHE: dict[tuple, tuple] = {}


def _permute_handler(func, args, kwargs):
    x = args[0]
    spec = x._spec
    try:
        key = (func, spec, _args_key(args[1:]), _key_of(tuple(kwargs.items())))
        plan = _PERM_CACHE.get(key)
    except _Unhashable:
        key, plan = None, None
    if plan is None:
        plan = _permute_plan(func, args, kwargs)
        if key is not None:
            _PERM_CACHE[key] = plan
    perm, out_spec = plan
    return _wrap(x._local.permute(perm) if perm else x._local, out_spec)


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
    inv = {src: dst for dst, src in enumerate(perm)}
    out = tuple(Shard(inv[p.dim]) if type(p) is Shard else p for p in spec.placements)
    shape = torch.Size(spec.shape[p] for p in perm)
    return perm, DTensorSpec(spec.mesh, out, shape)


register_handler(torch.Tensor.permute, torch.permute, torch.t, torch.Tensor.t, torch.transpose,
                 torch.Tensor.transpose, torch.swapaxes, torch.Tensor.swapaxes, torch.movedim,
                 torch.Tensor.movedim, torch.Tensor.T.__get__, torch.Tensor.mT.__get__,
                 name="permute_rule")(_permute_handler)


@register_op(torch.Tensor.expand, torch.Tensor.expand_as, torch.broadcast_to)
def expand_rule(call: OpCall) -> Sharding:
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


# ---------------------------------------------------------------------------- softmax & norms
@register_op(torch.softmax, torch.Tensor.softmax, F.softmax, torch.log_softmax,
             torch.Tensor.log_softmax, F.log_softmax)
def softmax_rule(call: OpCall) -> Sharding:
    x = call.args[0]
    dim = call.arg(1, "dim")
    if dim is None:
        raise ShardingError(f"{_name(call.func)} on a DTensor needs an explicit dim")
    pl = unshard(x._spec.placements, [dim % x.ndim])
    return Sharding([pl], pl, tuple(x._spec.shape))


@register_op(F.layer_norm, F.rms_norm if hasattr(F, "rms_norm") else None, F.group_norm)
def norm_rule(call: OpCall) -> Sharding:
    x = call.args[0]
    if call.func is F.group_norm:
        norm_dims = range(1, x.ndim)
    else:
        ns = call.arg(1, "normalized_shape")
        ns = (ns,) if isinstance(ns, int) else tuple(ns)
        norm_dims = range(x.ndim - len(ns), x.ndim)
    pl = unshard(x._spec.placements, norm_dims)
    targets: list[Placements | None] = [pl]
    targets += [(R,) * call.mesh.ndim] * (len(call.dtensors) - 1)
    return Sharding(targets, pl, tuple(x._spec.shape))


# ---------------------------------------------------------------------------- attention
@register_op(F.scaled_dot_product_attention)
def sdpa_rule(call: OpCall) -> Sharding:
    q, k, v = call.args[0], call.arg(1, "key"), call.arg(2, "value")
    mask = call.arg(3, "attn_mask")
    for t in (q, k, v, mask):
        if t is not None and not isinstance(t, DTensor):
            raise _mixing_error(call.func, t)
    nd = q.ndim
    tq, tk, tv, tm, out = [], [], [], [], []
    for m in range(call.mesh.ndim):
        choice = None
        for t in (q, k, v):
            p = t._spec.placements[m]
            if type(p) is Shard and p.dim < nd - 2:
                heads_ok = p.dim != nd - 3 or all(
                    x._spec.shape[p.dim] % call.mesh.shape[m] == 0 for x in (q, k, v))
                if heads_ok and all(x._spec.shape[p.dim] == q._spec.shape[p.dim] or
                                    p.dim == nd - 3 for x in (k, v)):
                    choice = p
                    break
        c = choice or R
        tq.append(c)
        tk.append(c)
        tv.append(c)
        out.append(c)
        if mask is not None:
            ms = mask._spec.shape
            lead = nd - len(ms)
            if type(c) is Shard and c.dim >= lead and ms[c.dim - lead] == q._spec.shape[c.dim]:
                tm.append(Shard(c.dim - lead))
            else:
                tm.append(R)
    targets = [tuple(tq), tuple(tk), tuple(tv)]
    if mask is not None:
        targets.append(tuple(tm))
    shape = tuple(q._spec.shape[:-1]) + (v._spec.shape[-1],)
    return Sharding(targets, tuple(out), shape)


# ---------------------------------------------------------------------------- embedding
@register_op(F.embedding)
def embedding_rule(call: OpCall) -> Sharding:
    ids, weight = call.args[0], call.args[1]
    if not (isinstance(ids, DTensor) and isinstance(weight, DTensor)):
        raise _mixing_error(call.func, ids if not isinstance(ids, DTensor) else weight)
    nd = ids.ndim
    ti, tw, out = [], [], []
    vocab_dims = []
    for m in range(call.mesh.ndim):
        pi, pw = ids._spec.placements[m], weight._spec.placements[m]
        if pw == Shard(1):
            ti.append(R)
            tw.append(pw)
            out.append(Shard(nd))
        elif pw == Shard(0) and type(pi) is not Shard:
            ti.append(R)
            tw.append(pw)
            out.append(_P_SUM)
            vocab_dims.append(m)
        else:
            pi = pi if type(pi) is Shard else R
            ti.append(pi)
            tw.append(R)
            out.append(pi)
    shape = tuple(ids._spec.shape) + (weight._spec.shape[1],)
    local = None
    if vocab_dims:
        wspec = DTensorSpec(call.mesh, tuple(tw), weight._spec.shape)
        (rows, _), (offset, _) = wspec.local_shape_and_offset()
        padding_idx = call.arg(2, "padding_idx")

        def local(idx, w, *a, **k):  # vocab-parallel lookup: rows outside this shard give 0
            shifted = idx - offset
            outside = (shifted < 0) | (shifted >= rows)
            emb = F.embedding(shifted.masked_fill(outside, 0), w)
            if padding_idx is not None:
                outside = outside | (idx == padding_idx % weight._spec.shape[0])
            return emb.masked_fill(outside.unsqueeze(-1), 0)
    return Sharding([tuple(ti), tuple(tw)], tuple(out), shape, local=local)


# ---------------------------------------------------------------------------- cat / split
@register_op(torch.cat, torch.concat, torch.concatenate, torch.stack)
def cat_rule(call: OpCall) -> Sharding:
    tensors = call.arg(0, "tensors")
    for t in tensors:
        if not isinstance(t, DTensor):
            raise _mixing_error(call.func, t)
    dim = call.arg(1, "dim", 0)
    nd = tensors[0].ndim
    is_stack = call.func is torch.stack
    dim = dim % (nd + 1 if is_stack else nd)
    first = tensors[0]._spec.placements
    pl = []
    for m, p in enumerate(first):
        if type(p) is Shard and not is_stack and p.dim == dim:
            p = R
        if type(p) is Partial and not all(t._spec.placements[m] == p for t in tensors):
            p = R
        if type(p) is Shard and not is_stack and any(
                t._spec.shape[p.dim] != first_shape for t in tensors
                for first_shape in (tensors[0]._spec.shape[p.dim],)):
            p = R
        pl.append(p)
    pl_t = tuple(pl)
    out = tuple(Shard(p.dim + (p.dim >= dim)) if is_stack and type(p) is Shard else p
                for p in pl_t)
    return Sharding([pl_t] * len(tensors), out, None)


@register_op(torch.split, torch.Tensor.split, torch.chunk, torch.Tensor.chunk,
             torch.unbind, torch.Tensor.unbind, torch.split_with_sizes,
             torch.Tensor.split_with_sizes, torch.tensor_split, torch.Tensor.tensor_split)
def split_rule(call: OpCall) -> Sharding:
    x = call.args[0]
    if call.func in (torch.unbind, torch.Tensor.unbind):
        dim = call.arg(1, "dim", 0)
    else:
        dim = call.arg(2, "dim", 0)
    dim = dim % x.ndim
    pl = unshard(x._spec.placements, [dim], partial_ok=True)
    shapes = infer_shapes(call.func, call.args, call.kwargs)
    drop = call.func in (torch.unbind, torch.Tensor.unbind)
    out = tuple(Shard(p.dim - (drop and p.dim > dim)) if type(p) is Shard else p for p in pl)
    return Sharding([pl], [out] * len(shapes), shapes)


# ---------------------------------------------------------------------------- dropout
@register_handler(F.dropout, torch.dropout, torch.Tensor.dropout if hasattr(torch.Tensor,
                  "dropout") else None, name="dropout (offset RNG)")
def _dropout(func, args, kwargs):
    x = args[0]
    p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
    training = args[2] if len(args) > 2 else kwargs.get("training", kwargs.get("train", True))
    inplace = args[3] if len(args) > 3 else kwargs.get("inplace", False)
    if not training or p == 0.0:
        return x
    spec = x._spec
    pl = unshard(spec.placements)
    out_spec = spec if pl == spec.placements else DTensorSpec(spec.mesh, pl, spec.shape)
    local = _localize(x, pl, pl, True)
    shape, offset = out_spec.local_shape_and_offset()
    keep = _random.uniform_block(tuple(spec.shape), shape, offset, torch.float32,
                                 local.device) >= p
    if p == 1.0:
        result = local * 0
    else:
        result = local * keep.to(local.dtype) / (1.0 - p)
    if inplace and out_spec is spec:
        with torch.no_grad():
            x._local.copy_(result)
        return x
    return _wrap(result, out_spec)


# ---------------------------------------------------------------------------- losses
@register_op(F.cross_entropy, F.nll_loss)
def cross_entropy_rule(call: OpCall) -> Sharding:
    x, target = call.args[0], call.arg(1, "target")
    if not isinstance(target, DTensor):
        raise _mixing_error(call.func, target)
    weight = call.arg(2, "weight")
    ignore_index = call.kwargs.get("ignore_index", -100)
    reduction = call.kwargs.get("reduction", "mean")
    if len(call.args) > 5 and call.func is F.cross_entropy:
        ignore_index = call.args[4]
    class_dim = 1 if x.ndim > 1 else 0
    tx, tt = [], []
    for m in range(call.mesh.ndim):
        p = x._spec.placements[m]
        if type(p) is Shard and p.dim != class_dim:
            tdim = p.dim if p.dim == 0 else p.dim - 1
            tx.append(p)
            tt.append(Shard(tdim))
        else:
            tx.append(R)
            tt.append(R)
    sharded = [m for m, p in enumerate(tx) if type(p) is Shard and call.mesh.shape[m] > 1]
    targets: list[Placements | None] = [tuple(tx), tuple(tt)]
    if isinstance(weight, DTensor):
        targets.append((R,) * call.mesh.ndim)
    tshape = tuple(target._spec.shape)
    if reduction == "none":
        out = tuple(p if type(p) is Shard else R for p in tt)
        return Sharding(targets, out, tshape)
    out = tuple(_P_SUM if m in sharded else R for m in range(call.mesh.ndim))
    if reduction == "sum" or not sharded:
        return Sharding(targets, out, ())
    func = call.func
    mesh = call.mesh

    def local(inp, tgt, *a, **k):  # mean over a sharded batch: local sum / global count
        k = dict(k)
        k["reduction"] = "sum"
        total = func(inp, tgt, *a, **k)
        w = k.get("weight", a[0] if a else None)
        valid = tgt != ignore_index
        if w is not None:
            count = (w[tgt.masked_fill(~valid, 0)] * valid).sum()
        else:
            count = valid.sum().to(total.dtype)
        count = count.detach().clone()
        for m in sharded:
            get_platform().all_reduce(count, "sum", mesh.get_group(m))
        return total / count

    return Sharding(targets, out, (), local=local)


# ---------------------------------------------------------------------------- indexing
@register_handler(torch.Tensor.__getitem__, name="getitem_rule")
def _getitem(func, args, kwargs):
    x, index = args[0], args[1]
    spec = x._spec
    items = index if isinstance(index, tuple) else (index,)
    simple = all(i is None or i is Ellipsis or isinstance(i, int | slice) for i in items)
    if not simple:
        if any(isinstance(i, DTensor) for i in items):
            raise ShardingError("indexing a DTensor with a DTensor index is not supported")
        local = _replicated(x)
        out = local[index]
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
    local = _localize(x, pl, None, False)
    out_local = local[index]
    out_pl = tuple(Shard(dim_map[p.dim]) if type(p) is Shard else p for p in pl)
    shape = infer_shapes(func, args, kwargs)
    return _wrap(out_local, DTensorSpec(spec.mesh, out_pl, torch.Size(shape)))


__all__ = ["einsum_sharding", "unshard", "view_placements"]


# ---------------------------------------------------------------------------- autograd entry
def _grad_local(t: DTensor, g: Any) -> Any:
    if g is None:
        return None
    if not isinstance(g, DTensor):
        raise _mixing_error(torch.autograd.backward, g)
    want = tuple(R if type(p) is Partial else p for p in t._spec.placements)
    return redistribute_autograd(g._local, g._spec.mesh, g._spec.placements, want,
                                 tuple(g._spec.shape))


def _as_list(x: Any) -> list:
    if x is None:
        return []
    return [x] if isinstance(x, torch.Tensor) else list(x)


@register_handler(torch.autograd.backward, name="autograd on local tensors")
def _autograd_backward(func, args, kwargs):
    kwargs = dict(kwargs)
    tensors = _as_list(args[0] if args else kwargs.pop("tensors"))
    grads = _as_list(args[1] if len(args) > 1 else kwargs.pop("grad_tensors", None))
    grads = grads or [None] * len(tensors)
    local_t = [t._local if isinstance(t, DTensor) else t for t in tensors]
    local_g = [_grad_local(t, g) if isinstance(t, DTensor) else g
               for t, g in zip(tensors, grads, strict=True)]
    if "inputs" in kwargs and kwargs["inputs"] is not None:
        kwargs["inputs"] = [i._local if isinstance(i, DTensor) else i
                            for i in _as_list(kwargs["inputs"])]
    return torch.autograd.backward(local_t, local_g, *args[2:], **kwargs)


@register_handler(torch.autograd.grad, name="autograd on local tensors")
def _autograd_grad(func, args, kwargs):
    kwargs = dict(kwargs)
    outputs = _as_list(args[0] if args else kwargs.pop("outputs"))
    inputs = _as_list(args[1] if len(args) > 1 else kwargs.pop("inputs"))
    grads = _as_list(args[2] if len(args) > 2 else kwargs.pop("grad_outputs", None))
    grads = grads or [None] * len(outputs)
    local_o = [o._local if isinstance(o, DTensor) else o for o in outputs]
    local_g = [_grad_local(o, g) if isinstance(o, DTensor) else g
               for o, g in zip(outputs, grads, strict=True)]
    local_i = [i._local if isinstance(i, DTensor) else i for i in inputs]
    res = torch.autograd.grad(local_o, local_i, local_g, *args[3:], **kwargs)
    out = []
    for i, g in zip(inputs, res, strict=True):
        if isinstance(i, DTensor) and g is not None:
            spec = i._spec
            gp = tuple(R if type(p) is Partial else p for p in spec.placements)
            g = _wrap(g, DTensorSpec(spec.mesh, gp, spec.shape))
        out.append(g)
    return tuple(out)


# ---------------------------------------------------------------------------- module plumbing
@register_handler(torch._has_compatible_shallow_copy_type, name="module _apply support")
def _compatible(func, args, kwargs):
    a, b = args[0], args[1]
    return isinstance(a, DTensor) and isinstance(b, DTensor) and a._spec is b._spec


@register_handler(torch.Tensor.data.__set__, name="data")
def _set_data(func, args, kwargs):
    self, value = args[0], args[1]
    if not isinstance(value, DTensor) or value._spec is not self._spec:
        raise ShardingError(
            "setting .data of a DTensor needs a DTensor with the same mesh, placements and "
            f"shape; got {type(value).__name__}")
    self._local.data = value._local


# ---------------------------------------------------------------------------- vector norm
@register_handler(torch.linalg.vector_norm, name="vector_norm (partial sums of |x|^p)")
def _vector_norm(func, args, kwargs):
    x = args[0]
    ord_ = args[1] if len(args) > 1 else kwargs.get("ord", 2)
    dim = args[2] if len(args) > 2 else kwargs.get("dim")
    keepdim = args[3] if len(args) > 3 else kwargs.get("keepdim", False)
    dtype = kwargs.get("dtype")
    spec = x._spec
    dims = _dims_arg(dim, x.ndim)
    pl = unshard(spec.placements)  # a norm of a pending sum needs the sum first
    if ord_ in (float("inf"), float("-inf"), 0) or isinstance(ord_, torch.Tensor):
        pl = unshard(pl, dims)
    local = _localize(x, pl, None, False)
    if dtype is not None:
        local = local.to(dtype)
    mesh = spec.mesh
    partial = [m for m, p in enumerate(pl) if type(p) is Shard and p.dim in dims]
    out_shape = _reduced_shape(tuple(spec.shape), dims, bool(keepdim))
    if not partial:
        out = torch.linalg.vector_norm(local, ord_, dims, bool(keepdim))
        return _wrap(out, DTensorSpec(mesh, _reduced_placements(pl, dims, bool(keepdim), "sum"),
                                      out_shape))
    powered = local.abs().pow(ord_).sum(dims, keepdim=bool(keepdim))
    src = _reduced_placements(pl, dims, bool(keepdim), "sum")
    dst = tuple(R if type(p) is Partial else p for p in src)
    total = redistribute_autograd(powered, mesh, src, dst, out_shape)
    return _wrap(total.pow(1.0 / ord_), DTensorSpec(mesh, dst, out_shape))


# ---------------------------------------------------------------------------- python protocol
@register_handler(torch.Tensor.__format__, name="format")
def _format(func, args, kwargs):
    return repr(args[0]) if not args[1] else format(_replicated(args[0]).detach(), args[1])


@register_handler(torch.Tensor.__iter__, name="iterate over dim 0 (unbind)")
def _iter(func, args, kwargs):
    return iter(args[0].unbind(0))


@register_handler(torch.equal, torch.Tensor.equal, torch.allclose, torch.Tensor.allclose,
                  torch.isclose, torch.Tensor.isclose, name="compare full tensors")
def _compare(func, args, kwargs):
    a, b = args[0], args[1]
    if not (isinstance(a, DTensor) and isinstance(b, DTensor)):
        raise _mixing_error(func, b if isinstance(a, DTensor) else a)
    if func in (torch.isclose, torch.Tensor.isclose):
        from .ops import _pointwise_handler

        return _pointwise_handler("other")(func, args, kwargs)
    return func(_replicated(a), _replicated(b), *args[2:], **kwargs)
