"""From a torch call on DTensors to the result: ``DTensor.__torch_function__``.

The function is looked up in :data:`~.registry.OP_TABLE`. A raw rule runs the op itself; a
:class:`~.registry.Sharding` rule is asked once per signature (op, input specs, non-tensor
arguments, grad mode) and its decision, turned into a :class:`Prepared` plan, is kept in the one
bounded :data:`PLAN_CACHE`; then the inputs are redistributed (differentiably), the op runs on
the local tensors and the outputs are wrapped. Families with plans of their own (elementwise,
views) keep them in the same cache under their own key prefix.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hyperpar.dtensor.placement import REPLICATE, Replicate, Shard
from hyperpar.platform import get_platform
from hyperpar.torch.dtensor._ops.registry import (
    OP_TABLE,
    P_SUM,
    OpCall,
    OpEntry,
    Placements,
    Sharding,
    collect_dtensors,
    no_rule_error,
    op_name,
)
from hyperpar.torch.dtensor._remesh import onto_one_mesh
from hyperpar.torch.dtensor.api import DTensor, DTensorSpec, TracedDTensor, _wrap
from hyperpar.torch.dtensor.redistribute import redistribute_autograd

_EMPTY: dict = {}
_is_compiling = torch.compiler.is_compiling


class PlanCache(dict):
    """A dict with a size cap: inserting into a full cache evicts the oldest entries first.

    Lookups are plain ``dict.get`` (the dispatch hot path); only :meth:`put` pays for the cap.
    Keys are shape-dependent, so without a cap a run with varying shapes would grow it forever.
    """

    def __init__(self, maxsize: int) -> None:
        super().__init__()
        self.maxsize = maxsize

    def put(self, key: Any, value: Any) -> Any:
        """Insert ``key``; evict the oldest eighth when full. Returns ``value``."""
        if len(self) >= self.maxsize:
            for k in list(self)[: max(1, self.maxsize // 8)]:
                del self[k]
        self[key] = value
        return value


#: The one cache of op decisions (rules, elementwise plans, view plans).
PLAN_CACHE = PlanCache(maxsize=8192)


# ---------------------------------------------------------------------------- copies
# Indexing or reshaping a DTensor across a sharded dim gathers it first: the result is a copy,
# where torch's tensor would be a view. An in-place op on it would silently leave the original
# unchanged (torch's DTensor drops such writes too), so it raises instead. id -> description;
# an entry leaves with its tensor (weakref.finalize), and the check costs nothing while empty.
_COPIES: dict[int, str] = {}


class InplaceOnCopyError(RuntimeError):
    """An in-place op on a DTensor that is a gathered copy, not a view, of another."""


def mark_copy(out: Any, note: str) -> Any:
    """Record that DTensor ``out`` is a copy made by ``note`` (e.g. ``x[0] of a DTensor
    sharded on dim 0``); return ``out``. Not recorded inside ``torch.compile`` (a graph holds
    no per-object records; torch's DTensor never raises here)."""
    if torch.compiler.is_compiling():
        return out
    key = id(out)
    _COPIES[key] = note
    weakref.finalize(out, _COPIES.pop, key, None)
    return out


def copy_note(x: Any) -> str | None:
    """How ``x`` was copied from another DTensor, or ``None`` when it is not such a copy."""
    return _COPIES.get(id(x)) if _COPIES else None


_INPLACE_DUNDERS = frozenset(
    f"__i{op}__" for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and",
                            "or", "xor", "lshift", "rshift", "matmul")) | {"__setitem__"}
_METADATA_ONLY = frozenset({"requires_grad_", "retain_grad", "share_memory_", "detach_"})


def _mutates(func: Any) -> bool:
    name = getattr(func, "__name__", "")
    if name.startswith("__"):
        return name in _INPLACE_DUNDERS
    return name.endswith("_") and name not in _METADATA_ONLY


def _check_not_a_copy(func: Any, args: Sequence) -> None:
    note = _COPIES.get(id(args[0]))
    if note is None or not _mutates(func):
        return
    name = getattr(func, "__name__", repr(func))
    raise InplaceOnCopyError(
        f"in-place {name}() on {note}: that value is a gathered copy, not a view, so the "
        f"write would not reach the original DTensor (torch's DTensor drops it silently). "
        f"Index or reshape only dims that are not sharded (a view of the local shard), or "
        f"compute the new value out of place and assign it to the original, e.g. "
        f"x.full_tensor() -> edit -> distribute_tensor(...) or x.copy_(new)")


class CustomFunctionError(RuntimeError):
    """A custom ``torch.autograd.Function`` over DTensors that hyperpar cannot run with its
    gradient intact (DTensors nested in a list or passed by keyword, forward-mode AD, a plain
    tensor returned as a DTensor's gradient): raised instead of a silently missing gradient.
    DTensors passed positionally are handled (:mod:`hyperpar.torch.dtensor.autograd_function`)."""


_grad_enabled = torch._C.is_grad_enabled
_fwd_grad_enabled = torch._C._is_fwd_grad_enabled


def _check_not_in_custom_function(func: Any, args: Sequence, kwargs: dict) -> None:
    """Called with grad and forward-grad both off: the state inside a custom autograd
    Function's forward (``torch.no_grad`` keeps forward grad on; inference mode and compiled
    tracing are excluded)."""
    if (torch.is_inference_mode_enabled() or _is_compiling()
            or torch._C._are_functorch_transforms_active()):
        return
    if any(d._local.requires_grad for d in collect_dtensors(args, kwargs)):
        raise CustomFunctionError(
            f"{op_name(func)} on a DTensor that requires grad inside a custom "
            f"torch.autograd.Function's forward, a DTensor the Function did not get as a "
            f"positional argument (nested in a list, passed by keyword, or captured): hyperpar "
            f"DTensors record autograd on their local tensors, so the result would be cut "
            f"from the graph (no gradient). Pass the DTensors to MyFunction.apply "
            f"positionally, or apply it to local tensors: hyperpar.local_map(MyFunction.apply, "
            f"out_placements=..., in_placements=...)")


def _torch_function(cls, func, types, args=(), kwargs=None):
    if _COPIES and args:
        _check_not_a_copy(func, args)
    if not _grad_enabled() and not _fwd_grad_enabled():
        _check_not_in_custom_function(func, args, kwargs or _EMPTY)
    entry = OP_TABLE.get(func)
    if entry is None:
        return _fallback(func, args, kwargs or _EMPTY)
    if entry.raw:
        return entry.rule(func, args, kwargs or _EMPTY)
    return run_rule(entry.rule, func, args, kwargs or _EMPTY)


DTensor.__torch_function__ = classmethod(_torch_function)  # type: ignore[assignment]


def call_entry(entry: OpEntry | None, func: Any, args: Sequence, kwargs: dict) -> Any:
    """Run ``func`` through ``entry`` (``None``: as if the op had no entry)."""
    if entry is None:
        return _fallback(func, args, kwargs)
    if entry.raw:
        return entry.rule(func, args, kwargs)
    return run_rule(entry.rule, func, args, kwargs)


# Attribute getters answered from the wrapper's metadata: every ``is_*`` flag plus these.
_META_ATTRS = {"layout", "names", "itemsize", "nbytes", "_base", "output_nr", "_version",
               "retains_grad", "_is_view", "grad_dtype"}
_INTROSPECTION = frozenset(getattr(torch.Tensor, name) for name in (
    "_is_view", "untyped_storage", "storage_offset", "stride", "is_contiguous", "is_conj",
    "is_neg", "is_inference", "dense_dim", "sparse_dim", "is_coalesced", "data_ptr",
    "_is_zerotensor"))
_FROM_LOCAL = ("_base", "output_nr", "_version", "retains_grad", "_is_view")


def _fallback(func: Any, args: Sequence, kwargs: dict) -> Any:
    if func in _INTROSPECTION or (args and type(args[0]) is TracedDTensor):
        # torch.compile asks a DTensor about its storage and views while it builds the graph:
        # the wrapper (or a traced DTensor, an alias of its local tensor) answers for itself
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    if getattr(func, "__name__", "") == "__get__":
        attr = getattr(getattr(func, "__self__", None), "__name__", "")
        if attr in _META_ATTRS or attr.startswith("is_"):
            if attr in _FROM_LOCAL:
                return getattr(args[0]._local, attr)
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
    raise no_rule_error(func, args, kwargs)


# ---------------------------------------------------------------------------- execution
def reduce_dims(target: Placements, outs: Placements) -> tuple[int, ...]:
    """Mesh dims where a replicated input feeds a sharded or Partial("sum") output."""
    return tuple(m for m, (t, o) in enumerate(zip(target, outs, strict=False))
                 if type(t) is Replicate and (type(o) is Shard or o == P_SUM))


class GradReducer:
    """Backward pre-hook that sums a gradient over mesh dims (one all-reduce per dim)."""

    __slots__ = ("mesh", "dims")

    def __init__(self, mesh: Any, dims: tuple[int, ...]) -> None:
        self.mesh = mesh
        self.dims = dims

    def __call__(self, grads: tuple) -> tuple | None:
        g = grads[0]
        if g is None:
            return None
        g = g.clone(memory_format=torch.contiguous_format)  # the incoming grad may be shared
        platform = get_platform()
        for m in self.dims:
            platform.all_reduce(g, "sum", self.mesh.get_group(m))
        return (g, *grads[1:])


def reduce_grad(x: torch.Tensor, reducer: GradReducer) -> torch.Tensor:
    """Identity whose backward sums the gradient over ``reducer``'s mesh dims: a replicated
    input of an op whose output is sharded or partial there gets one term of its gradient per
    rank. (A pre-hook on a view node costs half of an ``autograd.Function``.)"""
    if torch.compiler.is_compiling():  # a graph cannot hold a hook on a grad_fn
        return _ReduceGrad.apply(x, reducer.mesh, reducer.dims)
    y = x.view_as(x)
    y.grad_fn.register_prehook(reducer)
    return y


class _ReduceGrad(torch.autograd.Function):
    """:func:`reduce_grad` inside ``torch.compile``: identity, backward sums over mesh dims."""

    @staticmethod
    def forward(ctx, x, mesh, dims):  # type: ignore[override]
        ctx.mesh, ctx.dims = mesh, dims
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        g = grad.clone(memory_format=torch.contiguous_format)
        platform = get_platform()
        for m in ctx.dims:
            platform.all_reduce(g, "sum", ctx.mesh.get_group(m))
        return g, None, None


def localize(dt: DTensor, target: Placements | None, outs: Placements | None,
             reduce_grad: bool) -> torch.Tensor:
    """``dt``'s local tensor redistributed to ``target``; with ``reduce_grad`` its gradient is
    summed over the mesh dims where ``outs`` is sharded or partial."""
    spec = dt._spec
    x = dt._local
    if target is not None and target != spec.placements:
        x = redistribute_autograd(x, spec.mesh, spec.placements, target, tuple(spec.shape))
    else:
        target = spec.placements
    if reduce_grad and outs is not None and x.requires_grad and torch.is_grad_enabled():
        dims = tuple(m for m in reduce_dims(target, outs) if spec.mesh.shape[m] > 1)
        if dims:
            x = reduce_grad(x, GradReducer(spec.mesh, dims))
    return x


def replicated_local(dt: DTensor) -> torch.Tensor:
    """``dt``'s full value as a local tensor (differentiable)."""
    spec = dt._spec
    return redistribute_autograd(dt._local, spec.mesh, spec.placements,
                                 (REPLICATE,) * spec.mesh.ndim, tuple(spec.shape))


def _swap_one(a: Any, table: dict[int, torch.Tensor]) -> Any:
    if type(a) is DTensor or type(a) is TracedDTensor:
        return table[id(a)]
    if type(a) in (list, tuple) and any(isinstance(b, DTensor) for b in a):
        return type(a)(table[id(b)] if isinstance(b, DTensor) else b for b in a)
    return a


def swap_by_identity(args: Sequence, kwargs: dict, dts: Sequence, xs: Sequence
                     ) -> tuple[list, dict]:
    """``args``/``kwargs`` with ``dts[k]`` replaced by ``xs[k]``, matched by identity: the
    traced form of :func:`swap_locals` (``id()`` of a traced tensor would make Dynamo guard on
    that very object, recompiling for every new input)."""
    def find(a: Any) -> Any:
        for d, x in zip(dts, xs, strict=True):
            if d is a:
                return x
        return a

    def one(a: Any) -> Any:
        if isinstance(a, DTensor):
            return find(a)
        if type(a) in (list, tuple) and any(isinstance(b, DTensor) for b in a):
            return type(a)(find(b) if isinstance(b, DTensor) else b for b in a)
        return a

    return [one(a) for a in args], {k: one(v) for k, v in kwargs.items()}


def swap_locals(args: Sequence, kwargs: dict, table: dict[int, torch.Tensor]
                ) -> tuple[list, dict]:
    """``args``/``kwargs`` with every DTensor replaced by ``table[id(dtensor)]``."""
    largs = [_swap_one(a, table) for a in args]
    if not kwargs:
        return largs, kwargs
    return largs, {k: _swap_one(v, table) for k, v in kwargs.items()}


def _meta(x: Any) -> Any:
    if isinstance(x, DTensor):
        return torch.empty(x._spec.shape, dtype=x._local.dtype, device="meta")
    if isinstance(x, torch.Tensor):
        return torch.empty(x.shape, dtype=x.dtype, device="meta")
    if type(x) in (list, tuple):
        return type(x)(_meta(b) for b in x)
    return x


def infer_shapes(func: Any, args: Sequence, kwargs: dict) -> Any:
    """Global output shape(s) of ``func`` by running it on meta tensors."""
    with torch._C.DisableTorchFunctionSubclass():
        out = func(*[_meta(a) for a in args], **{k: _meta(v) for k, v in kwargs.items()})
    if isinstance(out, torch.Tensor):
        return out.shape
    return [o.shape if isinstance(o, torch.Tensor) else None for o in out]


class Prepared:
    """A rule's decision turned into what execution needs (cached per op signature)."""

    __slots__ = ("steps", "out_specs", "multi", "local", "no_redistribute", "pair")
    steps: list[tuple[Placements | None, GradReducer | None]]

    def __init__(self, call: OpCall, sh: Sharding) -> None:
        multi = isinstance(sh.outputs, list)
        first_out = sh.outputs[0] if multi else sh.outputs
        mesh = call.mesh
        steps = []
        for dt, target in zip(call.dtensors, sh.inputs, strict=False):
            spec = dt._spec
            tgt = None if target is None or target == spec.placements else target
            eff = spec.placements if tgt is None else tgt
            dims = tuple(m for m in reduce_dims(eff, first_out) if mesh.shape[m] > 1) \
                if sh.reduce_grad else ()
            steps.append((tgt, GradReducer(mesh, dims) if dims else None))
        self.steps = steps
        self.no_redistribute = all(t is None for t, _ in steps)
        shapes = sh.shapes if sh.shapes is not None else infer_shapes(call.func, call.args,
                                                                      call.kwargs)
        if multi:
            self.out_specs = [DTensorSpec(mesh, p, torch.Size(s))
                              for p, s in zip(sh.outputs, shapes, strict=False)]
        else:
            self.out_specs = DTensorSpec(mesh, sh.outputs, torch.Size(shapes))
        self.multi = multi
        self.local = sh.local
        # (DTensor, DTensor) ops with no redistribution: the gradient reductions per input
        self.pair = (steps[0][1], steps[1][1]) if (
            len(steps) == 2 and self.no_redistribute and not multi) else None


def local_arguments(args: Sequence, kwargs: dict, dts: Sequence[DTensor],
                    steps: Sequence[tuple[Any, Any]]) -> tuple[list, dict]:
    """``args``/``kwargs`` with each DTensor of ``dts`` replaced by its local tensor, first
    redistributed to the step's target placements and given the step's gradient reducer."""
    table: dict[int, torch.Tensor] = {}
    xs = []
    grad = torch.is_grad_enabled()
    for dt, (tgt, reducer) in zip(dts, steps, strict=False):
        x = dt._local
        if tgt is not None:
            spec = dt._spec
            x = redistribute_autograd(x, spec.mesh, spec.placements, tgt, tuple(spec.shape))
        if reducer is not None and grad and x.requires_grad:
            x = reduce_grad(x, reducer)
        if _is_compiling():
            xs.append(x)
        else:
            table[id(dt)] = x
    if _is_compiling():
        return swap_by_identity(args, kwargs, dts, xs)
    return swap_locals(args, kwargs, table)


def run_prepared(prep: Prepared, func: Any, args: Sequence, kwargs: dict,
                 dts: list[DTensor]) -> Any:
    """Execute a cached decision: redistribute, run locally, wrap."""
    largs, lkwargs = local_arguments(args, kwargs, dts, prep.steps)
    out = (prep.local or func)(*largs, **lkwargs)
    if not prep.multi:
        return _wrap(out, prep.out_specs)
    wrapped = [_wrap(o, s) if isinstance(o, torch.Tensor) else o
               for o, s in zip(out, prep.out_specs, strict=False)]
    return wrapped if type(out) is list else type(out)(wrapped)


def _decide(rule: Callable[[OpCall], Sharding], func: Any, args: Sequence, kwargs: dict,
            dts: list[DTensor]) -> Any:
    mesh = dts[0]._spec.mesh
    for d in dts[1:]:
        if d._spec.mesh != mesh:
            moved = onto_one_mesh(args, kwargs, dts)  # the same devices, dims transposed
            if moved is not None:
                return func(*moved[0], **moved[1])
            raise ValueError(
                f"{op_name(func)}: DTensor inputs live on different meshes "
                f"({mesh!r} and {d._spec.mesh!r}); redistribute them onto one mesh"
            )
    call = OpCall(func, tuple(args), dict(kwargs), dts)
    sh = rule(call)
    if not isinstance(sh, Sharding):
        return sh  # the rule computed the result itself
    return Prepared(call, sh)


def _run_uncached(rule: Callable[[OpCall], Sharding], func: Any, args: Sequence,
                  kwargs: dict) -> Any:
    dts = collect_dtensors(args, kwargs)
    if not dts:
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    prep = _decide(rule, func, args, kwargs, dts)
    if not isinstance(prep, Prepared):
        return prep
    return run_prepared(prep, func, args, kwargs, dts)


class Unhashable(Exception):
    """An argument that cannot be part of a cache key (the decision is then not cached)."""


_D, _T = object(), object()


def args_key(args: Sequence) -> tuple:
    """Cache key of positional arguments (DTensors stand for their spec, given separately)."""
    out = []
    for a in args:
        t = type(a)
        if t is DTensor:
            out.append(_D)
        elif t is int or t is float or t is bool or a is None:
            out.append(a)
        else:
            out.append(key_of(a))
    return tuple(out)


def key_of(a: Any) -> Any:
    """Cache key of one argument; raises :class:`Unhashable` for anything else."""
    if isinstance(a, DTensor):
        return _D
    if a is None or isinstance(a, int | float | bool | str | torch.dtype):
        return a
    if type(a) in (list, tuple, torch.Size):
        return tuple(key_of(b) for b in a)
    if isinstance(a, torch.Tensor):
        return (_T, tuple(a.shape), a.dtype)
    if isinstance(a, slice):
        return (slice, a.start, a.stop, a.step)
    raise Unhashable


def run_rule(rule: Callable[[OpCall], Sharding], func: Any, args: Sequence,
             kwargs: dict) -> Any:
    """Run ``func`` under a Sharding ``rule``, deciding at most once per signature."""
    if _is_compiling():  # traced: decide afresh (a constant of the graph), no cache
        return _run_uncached(rule, func, args, kwargs)
    if not kwargs and len(args) == 2 and type(args[0]) is DTensor:
        # fastest paths: (DTensor, DTensor) as in mm, (DTensor, int) as in sum(x, 1)
        a, b = args
        la = a._local
        if type(b) is DTensor:
            lb = b._local
            if (la.requires_grad or lb.requires_grad) and torch.is_grad_enabled():
                prep = PLAN_CACHE.get((func, a._spec, b._spec, True))
                if prep is not None and prep.pair is not None:
                    ra, rb = prep.pair
                    if ra is not None and la.requires_grad:
                        la = reduce_grad(la, ra)
                    if rb is not None and lb.requires_grad:
                        lb = reduce_grad(lb, rb)
                    return _wrap((prep.local or func)(la, lb), prep.out_specs)
            else:
                prep = PLAN_CACHE.get((func, a._spec, b._spec, False))
                if prep is not None and prep.no_redistribute and not prep.multi:
                    return _wrap((prep.local or func)(la, lb), prep.out_specs)
        elif type(b) is int and (not la.requires_grad or not torch.is_grad_enabled()):
            prep = PLAN_CACHE.get((func, a._spec, b, False))
            if prep is not None and prep.no_redistribute and not prep.multi:
                return _wrap((prep.local or func)(la, b), prep.out_specs)
    if not kwargs:
        # flat positional arguments (DTensors and numbers) -> one key
        parts: list[Any] = [func]
        dts: list[DTensor] = []
        grad = False
        for a in args:
            t = type(a)
            if t is DTensor:
                dts.append(a)
                parts.append(a._spec)
                if a._local.requires_grad:
                    grad = True
            elif t is int or t is float or t is bool or a is None:
                parts.append(a)
            else:
                break
        else:
            if dts:
                grad = grad and torch.is_grad_enabled()
                parts.append(grad)
                key = tuple(parts)
                prep = PLAN_CACHE.get(key)
                if prep is None:
                    prep = _decide(rule, func, args, kwargs, dts)
                    if not isinstance(prep, Prepared):
                        return prep
                    PLAN_CACHE.put(key, prep)
                if not grad and prep.no_redistribute and not prep.multi:
                    out = (prep.local or func)(*[a._local if type(a) is DTensor else a
                                                 for a in args])
                    return _wrap(out, prep.out_specs)
                return run_prepared(prep, func, args, kwargs, dts)
    dts = collect_dtensors(args, kwargs)
    if not dts:
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    grad = torch.is_grad_enabled() and any(d._local.requires_grad for d in dts)
    try:
        key = (func, tuple(d._spec for d in dts), args_key(args),
               key_of(tuple(kwargs.items())) if kwargs else None, grad)
        prep = PLAN_CACHE.get(key)
    except Unhashable:
        key, prep = None, None
    if prep is None:
        prep = _decide(rule, func, args, kwargs, dts)
        if not isinstance(prep, Prepared):
            return prep
        if key is not None:
            PLAN_CACHE.put(key, prep)
    return run_prepared(prep, func, args, kwargs, dts)
