"""Elementwise ops: broadcasting placements, the Partial algebra, the hot fast paths.

The placements come from the framework-neutral rule (:mod:`hyperpar.dtensor.rules.elementwise`:
the output is sharded where any input shards a non-broadcast dim; ``add``/``sub`` of partials of
one kind stay partial, ``mul``/``div`` by a replicated factor keep ``Partial("sum")``, anything
else reduces first); this module maps torch's functions to it and runs them, with fast paths for
layouts that need nothing. To support another elementwise op add its name to one of the lists
below.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from hyperpar.dtensor.rules import elementwise_plan
from hyperpar.torch.dtensor._ops.dispatch import (
    PLAN_CACHE,
    GradReducer,
    local_arguments,
    reduce_dims,
)
from hyperpar.torch.dtensor._ops.registry import (
    OpCall,
    Sharding,
    ShardingError,
    mixing_error,
    op_name,
    register_op,
    variants,
)
from hyperpar.torch.dtensor._remesh import onto_one_mesh
from hyperpar.torch.dtensor.api import DTensor, DTensorSpec, _wrap

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
    "and", "or", "xor", "invert", "mod", "rmod", "rpow", "rtruediv", "rdiv", "rsub", "rfloordiv",
    "floordiv", "truediv", "radd", "rmul", "lshift", "rshift", "rand", "ror", "rxor",
    "float", "double", "half", "bfloat16", "int", "long", "bool", "type_as", "to",
]
#: torch.nn.functional activations (elementwise, "other" kind), and their in-place forms
ACTIVATIONS = ["relu", "gelu", "silu", "sigmoid", "tanh", "leaky_relu", "elu", "softplus",
               "hardtanh", "relu6", "mish", "hardswish", "hardsigmoid", "logsigmoid", "selu",
               "celu", "glu_", "softsign", "tanhshrink", "threshold"]
INPLACE_ACTIVATIONS = ["relu_", "silu_", "gelu_", "leaky_relu_", "elu_", "hardtanh_",
                       "threshold_"]
_KIND_OF = {"radd": "linear", "rmul": "mul", "rsub": "linear", "truediv": "div"}
_CASTS = ("float", "double", "half", "bfloat16", "int", "long", "bool", "to", "type_as")
_DUNDER_ONLY = ("and", "or", "xor", "invert", "mod", "rmod", "rpow", "rtruediv", "rdiv",
                "rfloordiv", "floordiv", "truediv", "radd", "rmul", "rsub", "lshift", "rshift",
                "rand", "ror", "rxor")


def _funcs_by_kind() -> dict[tuple[str, bool], list[Any]]:
    """(kind, in-place) -> the torch functions of that kind, from the name lists."""
    where: dict[Any, tuple[str, bool]] = {}
    groups = [(LINEAR_POINTWISE, "linear"), (MUL_POINTWISE, "mul"), (DIV_POINTWISE, "div"),
              (OTHER_POINTWISE, "other")]
    for names, kind in groups:
        for name in names:
            k = _KIND_OF.get(name, kind)
            funcs = variants(name)
            if name in _CASTS:
                funcs = [getattr(torch.Tensor, name)]
                k = "linear" if name != "bool" else "other"
            if name in _DUNDER_ONLY:
                funcs = [getattr(torch.Tensor, f"__{name}__", None)]
            for f in funcs:
                if f is not None:
                    where[f] = (k, False)
            for f in variants(name, inplace=True, functional=name == "relu"):
                where[f] = (k, True)
    for name in ACTIVATIONS:
        f = getattr(F, name, None)
        if f is not None:
            where[f] = ("other", False)
    for name in INPLACE_ACTIVATIONS:
        for f in (getattr(F, name, None), getattr(torch, name, None)):
            if f is not None:
                where[f] = ("other", True)
    out: dict[tuple[str, bool], list[Any]] = {}
    for f, kk in where.items():
        out.setdefault(kk, []).append(f)
    return out


# ---------------------------------------------------------------------------- the plan
def pointwise_plan(kind: str, inplace: bool, metas: tuple, first_is_arg0: bool, mesh,
                   has_scalar: bool = False) -> tuple:
    """(targets, out placements, out shape, out spec) for an elementwise op: the neutral rule
    (:func:`hyperpar.dtensor.rules.elementwise_plan`) with torch's shape and spec types."""
    tg, outs, shape = elementwise_plan(kind, inplace, metas, first_is_arg0, mesh.ndim,
                                       has_scalar)
    out_shape = torch.Size(shape)
    return tg, outs, out_shape, DTensorSpec(mesh, outs, out_shape)


def pointwise_sharding(call: OpCall, kind: str = "other") -> Sharding:
    """The elementwise rule as a :class:`Sharding` (for rules built on it)."""
    metas = tuple((d._spec.placements, d._spec.shape) for d in call.dtensors)
    targets, outs, shape, _ = pointwise_plan(kind, False, metas,
                                              bool(call.args) and call.args[0] is
                                              call.dtensors[0], call.mesh)
    return Sharding(list(targets), outs, shape)


# ---------------------------------------------------------------------------- execution
_is_compiling = torch.compiler.is_compiling


def run_pointwise(func: Any, args: Sequence, kwargs: dict, kind: str, inplace: bool) -> Any:
    """Run an elementwise op of ``kind``; layouts that need nothing take the fast paths."""
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
                    plan = PLAN_CACHE.get((kind, inplace, spec, a1._spec, True, False))
                    if plan is not None and not _is_compiling():
                        (ta, da), (tb, db) = plan[0]
                        if ta is None and tb is None and not (
                                (da is not None or db is not None) and torch.is_grad_enabled()):
                            out = func(a0._local, a1._local)
                            return a0 if inplace else _wrap(out, plan[1])
                if not isinstance(a1, torch.Tensor):
                    out = func(a0._local, a1)
                    return a0 if inplace else _wrap(out, spec)
            elif not any(isinstance(a, torch.Tensor) for a in args[1:]):
                out = func(a0._local, *args[1:])
                return a0 if inplace else _wrap(out, spec)
    return _pointwise_slow(func, args, kwargs, kind, inplace)


def _pointwise_slow(func: Any, args: Sequence, kwargs: dict, kind: str, inplace: bool) -> Any:
    dts: list[DTensor] = []
    has_scalar = False
    for i, a in enumerate((*args, *kwargs.values())):
        if isinstance(a, DTensor):
            dts.append(a)
        elif isinstance(a, torch.Tensor):
            if a.ndim > 0:
                raise mixing_error(func, a)
            has_scalar = has_scalar or i < len(args)
        elif isinstance(a, int | float | complex) and not isinstance(a, bool):
            has_scalar = has_scalar or i < len(args)
    first = bool(args) and args[0] is dts[0]
    key = (kind, inplace, *[d._spec for d in dts], first, has_scalar)
    # traced: plan afresh (a constant of the graph), no cache
    plan = None if _is_compiling() else PLAN_CACHE.get(key)
    if plan is None:
        mesh = dts[0]._spec.mesh
        for d in dts[1:]:
            if d._spec.mesh != mesh:
                moved = onto_one_mesh(args, kwargs, dts)  # the same devices, dims transposed
                if moved is not None:
                    return func(*moved[0], **moved[1])
                raise ValueError(f"{op_name(func)}: DTensor inputs live on different meshes")
        if inplace and not first:
            raise ShardingError(f"{op_name(func)}: in-place op on a plain tensor with DTensor "
                                "args")
        metas = tuple((d._spec.placements, d._spec.shape) for d in dts)
        targets, outs, _, spec = pointwise_plan(kind, inplace, metas, first, mesh, has_scalar)
        steps = []
        for k, (t, m) in enumerate(zip(targets, metas, strict=True)):
            tgt = None if t == m[0] or (inplace and k == 0) else t
            dims = tuple(d for d in reduce_dims(t, outs) if mesh.shape[d] > 1)
            steps.append((tgt, GradReducer(mesh, dims) if dims else None))
        plan = (steps, spec)
        if not _is_compiling():
            PLAN_CACHE.put(key, plan)
    steps, spec = plan
    largs, lkwargs = local_arguments(args, kwargs, dts, steps)
    out = func(*largs, **lkwargs)
    if inplace:
        return args[0]
    return _wrap(out, spec)


# ---------------------------------------------------------------------------- the rules
_BY_KIND = _funcs_by_kind()


@register_op(_BY_KIND.get(("linear", False), []), raw=True)
def pointwise_linear(func, args, kwargs):
    """Elementwise, linear (add/sub/neg/casts): partials of one kind stay partial."""
    return run_pointwise(func, args, kwargs, "linear", False)


@register_op(_BY_KIND.get(("linear", True), []), raw=True)
def pointwise_linear_(func, args, kwargs):
    """In-place linear elementwise: the output keeps the first input's placements."""
    return run_pointwise(func, args, kwargs, "linear", True)


@register_op(_BY_KIND.get(("mul", False), []), raw=True)
def pointwise_mul(func, args, kwargs):
    """Elementwise product: Partial("sum") times a replicated factor stays Partial("sum")."""
    return run_pointwise(func, args, kwargs, "mul", False)


@register_op(_BY_KIND.get(("mul", True), []), raw=True)
def pointwise_mul_(func, args, kwargs):
    """In-place elementwise product: the output keeps the first input's placements."""
    return run_pointwise(func, args, kwargs, "mul", True)


@register_op(_BY_KIND.get(("div", False), []), raw=True)
def pointwise_div(func, args, kwargs):
    """Elementwise quotient: a Partial("sum") numerator over a replicated divisor stays
    Partial."""
    return run_pointwise(func, args, kwargs, "div", False)


@register_op(_BY_KIND.get(("div", True), []), raw=True)
def pointwise_div_(func, args, kwargs):
    """In-place elementwise quotient: the output keeps the first input's placements."""
    return run_pointwise(func, args, kwargs, "div", True)


@register_op(_BY_KIND.get(("other", False), []), raw=True)
def pointwise_other(func, args, kwargs):
    """Nonlinear elementwise (exp, relu, compare, ...): Partial inputs are reduced first."""
    return run_pointwise(func, args, kwargs, "other", False)


@register_op(_BY_KIND.get(("other", True), []), raw=True)
def pointwise_other_(func, args, kwargs):
    """In-place nonlinear elementwise: only on non-Partial inputs; placements kept."""
    return run_pointwise(func, args, kwargs, "other", True)
