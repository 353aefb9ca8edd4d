"""Sharding rules: how torch functions run on DTensors. One table, ``OP_TABLE``.

A rule is a pure function of the input placements and shapes (plus the op's non-tensor
arguments). It receives an :class:`OpCall` and returns a :class:`Sharding`: the placements each
DTensor input must have, the output placements and global shapes, and optionally a replacement
local function. The executor redistributes the inputs (differentiably), runs the op on the local
tensors and wraps the outputs. Adding an op is one rule plus one ``@register_op(...)`` line::

    @register_op(torch.erf, torch.Tensor.erf)
    def erf_rule(call: OpCall) -> Sharding:
        return pointwise_sharding(call)

An op without a rule raises :class:`ShardingError` naming the op and the input placements.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .api import DTensor, DTensorSpec, _wrap
from .placement import REPLICATE, Partial, Placement, Replicate, Shard
from .redistribute import ReduceGrad, redistribute_autograd

Placements = tuple[Placement, ...]

#: torch function -> handler(func, args, kwargs) -> result
OP_TABLE: dict[Any, Callable[..., Any]] = {}
_RULE_NAMES: dict[Any, str] = {}
_EMPTY: dict = {}
_P_SUM = Partial("sum")


class ShardingError(NotImplementedError):
    """No sharding rule for an op with these input placements."""


@dataclass
class OpCall:
    """What a rule sees: the function, its arguments, and the DTensor inputs (in argument order,
    lists flattened) with their specs."""

    func: Any
    args: tuple
    kwargs: dict
    dtensors: list[DTensor]

    @property
    def specs(self) -> list[DTensorSpec]:
        return [d._spec for d in self.dtensors]

    @property
    def mesh(self):
        return self.dtensors[0]._spec.mesh

    def arg(self, index: int, name: str, default: Any = None) -> Any:
        if len(self.args) > index:
            return self.args[index]
        return self.kwargs.get(name, default)


@dataclass
class Sharding:
    """A rule's decision. ``inputs``: target placements per DTensor input (``None`` keeps it);
    ``outputs``: placements of the output (a list of them for several outputs); ``shapes``: the
    global output shape(s), or ``None`` to infer them on meta tensors; ``local``: a function to
    call on the local arguments instead of the op; ``reduce_grad``: sum the gradient of
    replicated inputs over the mesh dims where the output is sharded or partial."""

    inputs: list[Placements | None]
    outputs: Placements | list[Placements]
    shapes: Any = None
    local: Callable[..., Any] | None = None
    reduce_grad: bool = True


def _name(func: Any) -> str:
    name = getattr(func, "__name__", None) or repr(func)
    if name == "__get__" and hasattr(func, "__self__"):
        name = f"Tensor.{getattr(func.__self__, '__name__', '?')} (attribute)"
    mod = getattr(func, "__module__", None) or ""
    qual = getattr(func, "__qualname__", name)
    if mod.startswith("torch.nn.functional"):
        return f"torch.nn.functional.{name}"
    if "Tensor" in qual or "TensorBase" in qual:
        return f"Tensor.{name}"
    return f"torch.{name}" if mod in ("torch", "torch._C._VariableFunctions", "") else \
        f"{mod}.{name}"


def _collect(args: Sequence, kwargs: dict) -> list[DTensor]:
    found = []
    for a in args:
        if isinstance(a, DTensor):
            found.append(a)
        elif type(a) in (list, tuple):
            found.extend(b for b in a if isinstance(b, DTensor))
    for a in kwargs.values():
        if isinstance(a, DTensor):
            found.append(a)
        elif type(a) in (list, tuple):
            found.extend(b for b in a if isinstance(b, DTensor))
    return found


def _no_rule(func: Any, args: Sequence, kwargs: dict) -> ShardingError:
    dts = _collect(args, kwargs)
    shown = ", ".join(f"{tuple(d._spec.shape)} {list(d._spec.placements)}" for d in dts)
    return ShardingError(
        f"hyperpar DTensor has no sharding rule for {_name(func)} with inputs [{shown}]. "
        "Call it on .to_local() / .full_tensor(), or add a rule with "
        "hyperpar.dtensor.register_op (see docs/dtensor.md)"
    )


def _torch_function(cls, func, types, args=(), kwargs=None):
    handler = OP_TABLE.get(func)
    if handler is not None:
        return handler(func, args, kwargs or _EMPTY)
    return _fallback(func, args, kwargs or _EMPTY)


DTensor.__torch_function__ = classmethod(_torch_function)  # type: ignore[assignment]

# Attribute getters that can be answered from the wrapper's metadata.
# (every ``is_*`` flag -- device kinds included -- plus these)
_META_ATTRS = {"layout", "names", "itemsize", "nbytes", "_base", "output_nr", "_version",
               "retains_grad", "_is_view"}


def _fallback(func: Any, args: Sequence, kwargs: dict) -> Any:
    if getattr(func, "__name__", "") == "__get__":
        attr = getattr(getattr(func, "__self__", None), "__name__", "")
        if attr in _META_ATTRS or attr.startswith("is_"):
            self = args[0]
            if attr in ("_base", "output_nr", "_version", "retains_grad", "_is_view"):
                return getattr(self._local, attr)
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
    raise _no_rule(func, args, kwargs)


def registered_ops() -> dict[str, str]:
    """Every registered torch function name -> the rule that handles it."""
    return {_name(f): r for f, r in _RULE_NAMES.items()}


# ---------------------------------------------------------------------------- execution
def _needs_grad(x: torch.Tensor) -> bool:
    return x.requires_grad and torch.is_grad_enabled()


def _reduce_dims(target: Placements, outs: Placements) -> tuple[int, ...]:
    return tuple(m for m, (t, o) in enumerate(zip(target, outs, strict=False))
                 if type(t) is Replicate and (type(o) is Shard or o == _P_SUM))


def _localize(dt: DTensor, target: Placements | None, outs: Placements | None,
              reduce_grad: bool) -> torch.Tensor:
    spec = dt._spec
    x = dt._local
    if target is not None and target != spec.placements:
        x = redistribute_autograd(x, spec.mesh, spec.placements, target, tuple(spec.shape))
    else:
        target = spec.placements
    if reduce_grad and outs is not None and _needs_grad(x):
        dims = _reduce_dims(target, outs)
        dims = tuple(m for m in dims if spec.mesh.shape[m] > 1)
        if dims:
            x = ReduceGrad.apply(x, spec.mesh, dims)
    return x


def _swap_one(a: Any, table: dict[int, torch.Tensor]) -> Any:
    if type(a) is DTensor:
        return table[id(a)]
    if type(a) in (list, tuple) and any(isinstance(b, DTensor) for b in a):
        return type(a)(table[id(b)] if isinstance(b, DTensor) else b for b in a)
    return a


def _swap(args: Sequence, kwargs: dict, table: dict[int, torch.Tensor]) -> tuple[list, dict]:
    largs = [table[id(a)] if type(a) is DTensor else _swap_one(a, table) for a in args]
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


class _Prepared:
    """A rule's decision turned into what execution needs (cached per op signature)."""

    __slots__ = ("steps", "out_specs", "multi", "local", "no_redistribute")

    def __init__(self, call: OpCall, sh: Sharding) -> None:
        multi = isinstance(sh.outputs, list)
        first_out = sh.outputs[0] if multi else sh.outputs
        mesh = call.mesh
        steps = []
        for dt, target in zip(call.dtensors, sh.inputs, strict=False):
            spec = dt._spec
            tgt = None if target is None or target == spec.placements else target
            eff = spec.placements if tgt is None else tgt
            dims = tuple(m for m in _reduce_dims(eff, first_out) if mesh.shape[m] > 1) \
                if sh.reduce_grad else ()
            steps.append((tgt, dims))
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


def _run(prep: _Prepared, func: Any, args: Sequence, kwargs: dict, dts: list[DTensor]) -> Any:
    table: dict[int, torch.Tensor] = {}
    grad = torch.is_grad_enabled()
    for dt, (tgt, dims) in zip(dts, prep.steps, strict=False):
        x = dt._local
        if tgt is not None:
            spec = dt._spec
            x = redistribute_autograd(x, spec.mesh, spec.placements, tgt, tuple(spec.shape))
        if dims and grad and x.requires_grad:
            x = ReduceGrad.apply(x, dt._spec.mesh, dims)
        table[id(dt)] = x
    largs, lkwargs = _swap(args, kwargs, table)
    out = (prep.local or func)(*largs, **lkwargs)
    if not prep.multi:
        return _wrap(out, prep.out_specs)
    wrapped = [_wrap(o, s) if isinstance(o, torch.Tensor) else o
               for o, s in zip(out, prep.out_specs, strict=False)]
    return wrapped if type(out) is list else type(out)(wrapped)


def execute(call: OpCall, sh: Sharding) -> Any:
    """Redistribute the inputs as ``sh`` says, run the op locally, wrap the outputs."""
    return _run(_Prepared(call, sh), call.func, call.args, call.kwargs, call.dtensors)


def _decide(rule: Callable[[OpCall], Sharding], func: Any, args: Sequence, kwargs: dict,
            dts: list[DTensor]) -> Any:
    mesh = dts[0]._spec.mesh
    for d in dts[1:]:
        if d._spec.mesh != mesh:
            raise ValueError(
                f"{_name(func)}: DTensor inputs live on different meshes "
                f"({mesh!r} and {d._spec.mesh!r}); redistribute them onto one mesh"
            )
    call = OpCall(func, tuple(args), dict(kwargs), dts)
    sh = rule(call)
    if not isinstance(sh, Sharding):
        return sh  # the rule computed the result itself
    return _Prepared(call, sh)


class _Unhashable(Exception):
    pass


def _args_key(args: Sequence) -> tuple:
    out = []
    for a in args:
        t = type(a)
        if t is DTensor:
            out.append(_D)
        elif t is int or t is float or t is bool or a is None:
            out.append(a)
        else:
            out.append(_key_of(a))
    return tuple(out)


def _key_of(a: Any) -> Any:
    if isinstance(a, DTensor):
        return _D
    if a is None or isinstance(a, int | float | bool | str | torch.dtype):
        return a
    if type(a) in (list, tuple, torch.Size):
        return tuple(_key_of(b) for b in a)
    if isinstance(a, torch.Tensor):
        return (_T, tuple(a.shape), a.dtype)
    if isinstance(a, slice):
        return (slice, a.start, a.stop, a.step)
    raise _Unhashable


_D, _T = object(), object()
_RULE_CACHE: dict[tuple, _Prepared] = {}


def register_op(*funcs: Any) -> Callable[[Callable[[OpCall], Sharding]], Callable]:
    """Register ``rule(call) -> Sharding`` for every torch function in ``funcs``.

    Decisions are cached per (op, input specs, non-tensor arguments, grad mode), so a rule runs
    once per signature; it must therefore depend only on those."""

    def deco(rule: Callable[[OpCall], Sharding]) -> Callable[[OpCall], Sharding]:
        def handler(func: Any, args: Sequence, kwargs: dict) -> Any:
            if not kwargs and len(args) == 2 and type(args[0]) is DTensor:
                # fastest paths: (DTensor, DTensor) as in mm, (DTensor, int) as in sum(x, 1)
                a, b = args
                la = a._local
                if type(b) is DTensor:
                    lb = b._local
                    if not (la.requires_grad or lb.requires_grad) or not torch.is_grad_enabled():
                        prep = _RULE_CACHE.get((func, a._spec, b._spec, False))
                        if prep is not None and prep.no_redistribute and not prep.multi:
                            return _wrap((prep.local or func)(la, lb), prep.out_specs)
                elif type(b) is int and (not la.requires_grad or not torch.is_grad_enabled()):
                    prep = _RULE_CACHE.get((func, a._spec, b, False))
                    if prep is not None and prep.no_redistribute and not prep.multi:
                        return _wrap((prep.local or func)(la, b), prep.out_specs)
            if not kwargs:
                # fast path: flat positional arguments (DTensors and numbers) -> one key
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
                        prep = _RULE_CACHE.get(key)
                        if prep is None:
                            prep = _decide(rule, func, args, kwargs, dts)
                            if not isinstance(prep, _Prepared):
                                return prep
                            _RULE_CACHE[key] = prep
                        if not grad and prep.no_redistribute and not prep.multi:
                            out = (prep.local or func)(*[a._local if type(a) is DTensor else a
                                                         for a in args])
                            return _wrap(out, prep.out_specs)
                        return _run(prep, func, args, kwargs, dts)
            dts = _collect(args, kwargs)
            if not dts:
                with torch._C.DisableTorchFunctionSubclass():
                    return func(*args, **kwargs)
            grad = torch.is_grad_enabled() and any(d._local.requires_grad for d in dts)
            try:
                key = (func, tuple(d._spec for d in dts), _args_key(args),
                       _key_of(tuple(kwargs.items())) if kwargs else None, grad)
                prep = _RULE_CACHE.get(key)
            except _Unhashable:
                key, prep = None, None
            if prep is None:
                prep = _decide(rule, func, args, kwargs, dts)
                if not isinstance(prep, _Prepared):
                    return prep
                if key is not None:
                    _RULE_CACHE[key] = prep
            return _run(prep, func, args, kwargs, dts)

        for f in funcs:
            if f is not None:
                OP_TABLE[f] = handler
                _RULE_NAMES[f] = rule.__name__
        return rule

    return deco


def register_handler(*funcs: Any, name: str) -> Callable[[Callable], Callable]:
    """Register a raw handler ``(func, args, kwargs) -> result`` (fast paths)."""

    def deco(handler: Callable) -> Callable:
        for f in funcs:
            if f is not None:
                OP_TABLE[f] = handler
                _RULE_NAMES[f] = name
        return handler

    return deco


def _variants(name: str, *, inplace: bool = False, functional: bool = False) -> list[Any]:
    """torch.<name>, Tensor.<name>, Tensor.__<name>__ (and in-place spellings if asked)."""
    out: list[Any] = []
    if inplace:
        for n in (f"{name}_", f"__i{name}__"):
            out.append(getattr(torch.Tensor, n, None))
        if functional:
            out.append(getattr(F, f"{name}_", None))
        return [f for f in out if f is not None]
    out.append(getattr(torch, name, None))
    out.append(getattr(torch.Tensor, name, None))
    out.append(getattr(torch.Tensor, f"__{name}__", None))
    if functional:
        out.append(getattr(F, name, None))
    seen, uniq = set(), []
    for f in out:
        if f is not None and id(f) not in seen:
            seen.add(id(f))
            uniq.append(f)
    return uniq


class MixedTensorError(RuntimeError):
    """A DTensor op got a plain (non-scalar) torch.Tensor argument."""


def _mixing_error(func: Any, t: Any) -> MixedTensorError:
    return MixedTensorError(
        f"{_name(func)}: got a mix of DTensor and torch.Tensor (shape {tuple(t.shape)}); "
        "convert the plain tensor with distribute_tensor or DTensor.from_local first "
        "(0-dim tensors and Python numbers are allowed)"
    )


# ---------------------------------------------------------------------------- pointwise
_PW_CACHE: dict[tuple, tuple] = {}


def _pointwise_plan(kind: str, inplace: bool, metas: tuple, first_is_arg0: bool, mesh,
                    has_scalar: bool = False) -> tuple:
    """(targets, out placements, out shape, out spec) for an elementwise op."""
    shapes = [m[1] for m in metas]
    out_shape = torch.Size(torch.broadcast_shapes(*shapes)) if not inplace else shapes[0]
    nd = len(out_shape)
    n_ops = len(metas)
    targets: list[list[Placement]] = [[] for _ in range(n_ops)]
    outs: list[Placement] = []
    for m in range(mesh.ndim):
        cur = [meta[0][m] for meta in metas]
        out: Placement | None = None
        if inplace:
            out = cur[0]
        else:
            for k, p in enumerate(cur):
                if type(p) is Shard:
                    d_out = p.dim + nd - len(shapes[k])
                    if shapes[k][p.dim] == out_shape[d_out]:
                        out = Shard(d_out)
                        break
        if out is None or type(out) is Partial:
            partial_out = _partial_result(kind, cur, first_is_arg0, has_scalar)
            if type(out) is Partial and partial_out != out:
                raise ShardingError(
                    f"in-place {kind} op on a Partial({out.reduce_op!r}) tensor with inputs "
                    f"{cur} would not keep it Partial; redistribute it to Replicate first")
            out = partial_out
        outs.append(out)
        for k, p in enumerate(cur):
            if type(out) is Shard:
                dk = out.dim - (nd - len(shapes[k]))
                if dk >= 0 and shapes[k][dk] == out_shape[out.dim]:
                    targets[k].append(Shard(dk))
                else:
                    targets[k].append(REPLICATE)
            elif type(out) is Partial:
                if type(p) is Partial:
                    targets[k].append(p)
                elif out.reduce_op == "sum" and kind == "linear":
                    targets[k].append(_P_SUM)
                else:
                    targets[k].append(REPLICATE)
            else:
                targets[k].append(REPLICATE)
    outs_t = tuple(outs)
    tg = tuple(tuple(t) for t in targets)
    if inplace and tg[0] != metas[0][0]:
        raise ShardingError(
            f"in-place op would need to change the placements of its output {metas[0][0]}")
    return tg, outs_t, out_shape, DTensorSpec(mesh, outs_t, out_shape)


def _partial_result(kind: str, cur: list[Placement], first_is_arg0: bool,
                    has_scalar: bool = False) -> Placement:
    partials = [p for p in cur if type(p) is Partial]
    if not partials:
        return REPLICATE
    if kind == "linear":
        ops = {p.reduce_op for p in partials}
        # x + c on a Partial("sum") would add c once per rank: only "avg" absorbs a constant
        if len(ops) == 1 and next(iter(ops)) in (("avg",) if has_scalar else ("sum", "avg")):
            return partials[0]
    elif kind in ("mul", "div") and len(partials) == 1 and partials[0] == _P_SUM:
        if kind == "mul" or (first_is_arg0 and type(cur[0]) is Partial):
            return _P_SUM
    return REPLICATE


def _pointwise_handler(kind: str, inplace: bool = False) -> Callable:
    def handler(func: Any, args: Sequence, kwargs: dict) -> Any:
        a0 = args[0] if args else None
        if type(a0) is DTensor and not kwargs:
            spec = a0._spec
            if not spec.has_partial:
                n = len(args)
                if n == 1:
                    return a0 if inplace else _wrap(func(a0._local), spec)
                a1 = args[1]
                if n == 2:
                    if type(a1) is DTensor:
                        # same layout on both sides: no communication, no gradient reduction
                        if a1._spec is spec:
                            out = func(a0._local, a1._local)
                            return a0 if inplace else _wrap(out, spec)
                        plan = _PW_CACHE.get((kind, inplace, spec, a1._spec, True, False))
                        if plan is not None:
                            (ta, da), (tb, db) = plan[0]
                            if ta is None and tb is None and not (
                                    (da or db) and torch.is_grad_enabled()):
                                out = func(a0._local, a1._local)
                                return a0 if inplace else _wrap(out, plan[1])
                    if not isinstance(a1, torch.Tensor):
                        out = func(a0._local, a1)
                        return a0 if inplace else _wrap(out, spec)
                elif not any(isinstance(a, torch.Tensor) for a in args[1:]):
                    out = func(a0._local, *args[1:])
                    return a0 if inplace else _wrap(out, spec)
        return _pointwise_general(func, args, kwargs, kind, inplace)

    return handler


def _pointwise_general(func: Any, args: Sequence, kwargs: dict, kind: str, inplace: bool) -> Any:
    if not kwargs and len(args) == 2 and type(args[0]) is DTensor and type(args[1]) is DTensor:
        a, b = args
        plan = _PW_CACHE.get((kind, inplace, a._spec, b._spec, True, False))
        if plan is not None:
            (ta, da), (tb, db) = plan[0]
            spec = plan[1]
            la, lb = a._local, b._local
            if ta is not None or tb is not None or ((da or db) and torch.is_grad_enabled()):
                return _pointwise_slow(func, args, kwargs, kind, inplace)
            out = func(la, lb)
            return a if inplace else _wrap(out, spec)
    return _pointwise_slow(func, args, kwargs, kind, inplace)


def _pointwise_slow(func: Any, args: Sequence, kwargs: dict, kind: str, inplace: bool) -> Any:
    dts: list[DTensor] = []
    has_scalar = False
    for i, a in enumerate((*args, *kwargs.values())):
        if isinstance(a, DTensor):
            dts.append(a)
        elif isinstance(a, torch.Tensor):
            if a.ndim > 0:
                raise _mixing_error(func, a)
            has_scalar = has_scalar or i < len(args)
        elif isinstance(a, int | float | complex) and not isinstance(a, bool):
            has_scalar = has_scalar or i < len(args)
    first = bool(args) and args[0] is dts[0]
    key = (kind, inplace, *[d._spec for d in dts], first, has_scalar)
    plan = _PW_CACHE.get(key)
    if plan is None:
        mesh = dts[0]._spec.mesh
        for d in dts[1:]:
            if d._spec.mesh != mesh:
                raise ValueError(f"{_name(func)}: DTensor inputs live on different meshes")
        if inplace and not first:
            raise ShardingError(f"{_name(func)}: in-place op on a plain tensor with DTensor args")
        metas = tuple((d._spec.placements, d._spec.shape) for d in dts)
        targets, outs, _, spec = _pointwise_plan(kind, inplace, metas, first, mesh, has_scalar)
        steps = []
        for k, (t, m) in enumerate(zip(targets, metas, strict=True)):
            tgt = None if t == m[0] or (inplace and k == 0) else t
            dims = tuple(d for d in _reduce_dims(t, outs) if mesh.shape[d] > 1)
            steps.append((tgt, dims))
        plan = _PW_CACHE[key] = (steps, spec)
    steps, spec = plan
    table = {}
    grad = torch.is_grad_enabled()
    for d, (tgt, dims) in zip(dts, steps, strict=False):
        x = d._local
        if tgt is not None:
            dspec = d._spec
            x = redistribute_autograd(x, dspec.mesh, dspec.placements, tgt, tuple(dspec.shape))
        if dims and grad and x.requires_grad:
            x = ReduceGrad.apply(x, d._spec.mesh, dims)
        table[id(d)] = x
    largs, lkwargs = _swap(args, kwargs, table)
    out = func(*largs, **lkwargs)
    if inplace:
        return args[0]
    return _wrap(out, spec)


def pointwise_sharding(call: OpCall, kind: str = "other") -> Sharding:
    """The elementwise rule as a :class:`Sharding` (for rules built on it)."""
    metas = tuple((d._spec.placements, d._spec.shape) for d in call.dtensors)
    targets, outs, shape, _ = _pointwise_plan(kind, False, metas,
                                               bool(call.args) and call.args[0] is
                                               call.dtensors[0], call.mesh)
    return Sharding(list(targets), outs, shape)


LINEAR_POINTWISE = ["add", "sub", "subtract", "neg", "negative", "positive", "clone",
                    "real", "conj", "conj_physical", "resolve_conj", "resolve_neg"]
MUL_POINTWISE = ["mul", "multiply"]
DIV_POINTWISE = ["div", "divide", "true_divide"]
OTHER_POINTWISE = [
    "abs", "acos", "asin", "atan", "atan2", "ceil", "clamp", "clamp_min", "clamp_max", "clip",
    "cos", "cosh", "erf", "erfc", "erfinv", "exp", "exp2", "expm1", "floor", "floor_divide",
    "fmod", "frac", "log", "log10", "log1p", "log2", "logical_and", "logical_not", "logical_or",
    "logical_xor", "maximum", "minimum", "fmax", "fmin", "pow", "float_power", "reciprocal",
    "relu", "remainder", "round", "rsqrt", "sigmoid", "sign", "sin", "sinh", "sqrt", "square",
    "tan", "tanh", "trunc", "where", "masked_fill", "lerp", "addcmul", "addcdiv", "hypot",
    "eq", "ne", "lt", "le", "gt", "ge", "bitwise_and", "bitwise_or", "bitwise_xor",
    "bitwise_not", "isnan", "isinf", "isfinite", "nan_to_num", "sgn", "heaviside", "xlogy",
    "logaddexp", "copysign", "signbit", "threshold", "rad2deg", "deg2rad", "lgamma", "digamma",
    "and", "or", "xor", "invert", "mod", "rpow", "rtruediv", "rdiv", "rsub", "rfloordiv",
    "floordiv", "truediv", "radd", "rmul", "lshift", "rshift", "rand", "ror", "rxor",
    "float", "double", "half", "bfloat16", "int", "long", "bool", "type_as", "to",
]


def _register_pointwise() -> None:
    groups = [(LINEAR_POINTWISE, "linear"), (MUL_POINTWISE, "mul"), (DIV_POINTWISE, "div"),
              (OTHER_POINTWISE, "other")]
    for names, kind in groups:
        for name in names:
            k = kind
            if name in ("radd",):
                k = "linear"
            elif name in ("rmul",):
                k = "mul"
            elif name in ("rsub",):
                k = "linear"
            elif name in ("truediv",):
                k = "div"
            funcs = _variants(name)
            if name in ("float", "double", "half", "bfloat16", "int", "long", "bool", "to",
                        "type_as"):
                funcs = [getattr(torch.Tensor, name)]
                k = "linear" if name != "bool" else "other"
            if name in ("and", "or", "xor", "invert", "mod", "rpow", "rtruediv", "rdiv",
                        "rfloordiv", "floordiv", "truediv", "radd", "rmul", "rsub", "lshift",
                        "rshift", "rand", "ror", "rxor"):
                funcs = [getattr(torch.Tensor, f"__{name}__", None)]
            register_handler(*funcs, name=f"pointwise[{k}]")(_pointwise_handler(k))
            ifuncs = _variants(name, inplace=True, functional=name in ("relu",))
            register_handler(*ifuncs, name=f"pointwise[{k}] in-place")(
                _pointwise_handler(k, inplace=True))
    for name in ("relu", "gelu", "silu", "sigmoid", "tanh", "leaky_relu", "elu", "softplus",
                 "hardtanh", "relu6", "mish", "hardswish", "hardsigmoid", "logsigmoid", "selu",
                 "celu", "glu_", "softsign", "tanhshrink", "threshold"):
        f = getattr(F, name, None)
        if f is not None:
            register_handler(f, name="pointwise[other]")(_pointwise_handler("other"))
    for name in ("relu_", "silu_", "gelu_", "leaky_relu_", "elu_", "hardtanh_", "threshold_"):
        for f in (getattr(F, name, None), getattr(torch, name, None)):
            if f is not None:
                register_handler(f, name="pointwise[other] in-place")(
                    _pointwise_handler("other", inplace=True))


_register_pointwise()
from . import rules as _rules  # noqa: E402,F401  (registers the non-pointwise rules)
