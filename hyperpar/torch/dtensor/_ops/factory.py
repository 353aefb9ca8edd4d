"""Ops that make or fill tensors: ``*_like``, ``new_*``, ``copy_``/``fill_``/``zero_``, the
random initialisers (offset-based random numbers, equal to the unsharded tensor's) and every
``torch.nn.init`` function (see the section at the end of this file)."""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Sequence
from typing import Any

import torch

from hyperpar.dtensor.layout import partial_fill_identity, shard_slices
from hyperpar.dtensor.placement import REPLICATE, grad_placements_of
from hyperpar.dtensor.rules.base import refuse_partial, spelled_dims
from hyperpar.torch.dtensor import random as _random
from hyperpar.torch.dtensor._ops.dispatch import replicated_local
from hyperpar.torch.dtensor._ops.registry import mixing_error, op_name, register_op
from hyperpar.torch.dtensor.api import DTensor, DTensorSpec, _wrap
from hyperpar.torch.dtensor.random import uniform_block
from hyperpar.torch.dtensor.redistribute import redistribute_autograd

R = REPLICATE


# ---------------------------------------------------------------------------- *_like / new_*
_LIKE = {getattr(torch, f"{fill}_like"): fill
         for fill in ("zeros", "ones", "empty", "full", "rand", "randn")}


@register_op(list(_LIKE), raw=True)
def like_rule(func, args, kwargs):
    """``*_like``: the input's layout (Partial -> Replicate unless zeros/empty), no
    communication; ``rand_like``/``randn_like`` use offset-based random numbers."""
    fill = _LIKE[func]
    x = args[0]
    kwargs = dict(kwargs)
    kwargs.pop("memory_format", None)
    spec = x._spec
    # a non-zero fill of a pending sum would count n times: replicated, as a gradient is
    zero = fill == "zeros" or fill == "empty"
    placements = spec.placements if zero else grad_placements_of(spec.placements)
    out_spec = spec if placements == spec.placements else DTensorSpec(spec.mesh, placements,
                                                                      spec.shape)
    local_shape, offset = out_spec.local_shape_and_offset()
    dtype = kwargs.pop("dtype", None) or x._local.dtype
    requires_grad = kwargs.pop("requires_grad", False)
    # device= moves the shard (Module.to_empty: meta -> a real device)
    device = kwargs.pop("device", None) or x._local.device
    if fill in ("rand", "randn"):
        block = _random.uniform_block if fill == "rand" else _random.normal_block
        local = block(tuple(spec.shape), local_shape, offset, dtype, device)
    elif fill == "full":
        local = torch.full(local_shape, args[1] if len(args) > 1 else kwargs["fill_value"],
                           dtype=dtype, device=device)
    else:
        local = getattr(torch, fill)(local_shape, dtype=dtype, device=device)
    return _wrap(local.requires_grad_(requires_grad), out_spec)


_NEW = {getattr(torch.Tensor, f"new_{fill}"): fill for fill in ("zeros", "ones", "empty", "full")}


@register_op(list(_NEW), raw=True)
def new_rule(func, args, kwargs):
    """``Tensor.new_*``: a replicated DTensor of the given size on the input's mesh."""
    fill = _NEW[func]
    x = args[0]
    rest = args[1:]
    kwargs = dict(kwargs)
    if fill == "full":
        size, value = rest[0], rest[1] if len(rest) > 1 else kwargs.pop("fill_value")
    else:
        size = spelled_dims(rest)
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


# ---------------------------------------------------------------------------- in-place init
@register_op(torch.Tensor.copy_, raw=True)
def _copy_(func, args, kwargs):
    """``copy_``: a DTensor source is redistributed to the destination's layout; a full plain
    tensor gives this rank's piece."""
    dst, src = args[0], args[1]
    spec = dst._spec
    if isinstance(src, DTensor):
        local = redistribute_autograd(src._local, spec.mesh, src._spec.placements,
                                      spec.placements, tuple(src._spec.shape))
    else:
        if src.ndim and tuple(src.shape) != tuple(spec.shape):
            raise mixing_error(func, src)
        refuse_partial(spec.placements, "copy_ of a plain tensor", "redistribute it first")
        local = src[shard_slices(tuple(spec.shape), spec.placements, spec.mesh)] \
            if src.ndim else src
    dst._local.copy_(local, *args[2:], **kwargs)
    return dst


@register_op(torch.Tensor.zero_, getattr(torch, "zero_", None), torch.nn.init.zeros_, raw=True)
def _zero_(func, args, kwargs):
    """``zero_``/``nn.init.zeros_``: zero the local piece (any layout)."""
    x = _init_args(args, kwargs)[0]
    with torch.no_grad() if func is torch.nn.init.zeros_ else contextlib.nullcontext():
        x._local.zero_()
    return x


@register_op(torch.Tensor.fill_, torch.nn.init.constant_, torch.nn.init.ones_,
                  raw=True)
def _fill_(func, args, kwargs):
    """``fill_``/``constant_``/``ones_``: fill the local piece (a Partial sum or product: rank 0
    of the mesh dim only, the others the reduction's identity)."""
    x, rest, kwargs = _init_args(args, kwargs)
    value = 1.0 if func is torch.nn.init.ones_ else (rest[0] if rest
                                                     else kwargs.get("value", kwargs.get("val")))
    if isinstance(value, DTensor):
        value = replicated_local(value)
    spec = x._spec
    # torch.nn.init functions fill without recording autograd (torch dispatches constant_
    # to us before entering its own no_grad)
    with torch.no_grad() if func is not torch.Tensor.fill_ else contextlib.nullcontext():
        identity = partial_fill_identity(spec.placements, spec.mesh._coordinate)
        x._local.fill_(value if identity is None else identity)
    return x


def _init_args(args: Sequence, kwargs: dict) -> tuple[Any, tuple, dict]:
    """nn.init functions pass the tensor as ``tensor=``."""
    if args:
        return args[0], tuple(args[1:]), dict(kwargs)
    kwargs = dict(kwargs)
    return kwargs.pop("tensor"), (), kwargs


_RANDOM_INIT = {torch.Tensor.uniform_: "uniform", torch.nn.init.uniform_: "uniform",
                torch.Tensor.normal_: "normal", torch.nn.init.normal_: "normal"}


@register_op(list(_RANDOM_INIT), raw=True)
def random_init_rule(func, args, kwargs):
    """``uniform_``/``normal_``: each rank fills its piece with the offset-based random
    numbers of the whole tensor (no communication; not on Partial). ``trunc_normal_`` and the
    other ``torch.nn.init`` functions: :mod:`.init`."""
    kind = _RANDOM_INIT[func]
    x, params, kwargs = _init_args(args, kwargs)
    spec = x._spec
    refuse_partial(spec.placements, op_name(func), "redistribute it first")
    if kwargs.get("generator") is not None:
        # an explicit torch generator: draw the whole tensor from it as one process would
        # and keep this rank's piece (bitwise equal to one process with that generator)
        plain = {torch.Tensor.uniform_: torch.Tensor.uniform_,
                 torch.Tensor.normal_: torch.Tensor.normal_}.get(func, func)
        return init_materialised(plain, (x, *params), kwargs)
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
    with torch.no_grad():
        local.copy_(vals.to(local.dtype))
    return x


# ---------------------------------------------------------------------------- torch.nn.init
# ``torch.nn.init`` on DTensors: every initialiser fills each rank's piece of the whole tensor.
#
# Two routes, both without communication:
#
# * **offset-based** (the default): ``uniform_``, ``normal_``, ``trunc_normal_``, ``kaiming_*``,
#   ``xavier_*`` compute their bound from the *global* shape and draw through the DTensor's
#   ``uniform_``/``normal_``, which use the counter-based generator of
#   :mod:`hyperpar.torch.dtensor.random` -- the sharded result equals that generator's one-process
#   result bitwise, for any layout and world size (not torch's generator: see docs/fsdp.md).
# * **materialised**: an initialiser that needs the whole tensor's values (``orthogonal_``,
#   ``sparse_``, ``eye_``, ``dirac_``), or a random call given an explicit ``generator=``, runs on
#   a plain tensor of the global shape on every rank (drawing from torch's generator exactly as
#   one process would) and each rank keeps its piece -- bitwise equal to one process with the
#   same generator state, at the cost of one full-size temporary per call.
#
# torch routes only ``uniform_``, ``normal_``, ``constant_`` and ``kaiming_uniform_`` through
# ``__torch_function__``; ``kaiming_normal_``/``xavier_*``/``trunc_normal_``/``zeros_``/``ones_``
# run their Python body on the DTensor (which only needs the DTensor's own ops). The
# materialised four and ``trunc_normal_`` (which calls ``new_tensor``) would fail that way, so
# :func:`install` wraps them in ``torch.nn.init``
# (a DTensor argument takes the rule here; anything else calls torch's function unchanged).

_INIT = torch.nn.init

#: initialisers whose values depend on the whole tensor
_MATERIALISED = ("orthogonal_", "sparse_", "eye_", "dirac_")


def _split(func: Any, args: tuple, kwargs: dict) -> tuple[DTensor, tuple, dict]:
    if args:
        return args[0], tuple(args[1:]), dict(kwargs)
    kwargs = dict(kwargs)
    return kwargs.pop("tensor"), (), kwargs


def _check(func: Any, x: DTensor) -> None:
    refuse_partial(x._spec.placements, f"torch.nn.init.{func.__name__}")


@register_op(_INIT.kaiming_uniform_, raw=True)
def kaiming_uniform_rule(func: Any, args: tuple, kwargs: dict) -> DTensor:
    """``kaiming_uniform_``: the bound from the global shape (torch's own fan and gain
    helpers on a shape-only stand-in), then the DTensor's ``uniform_``."""
    x, rest, kwargs = _split(func, args, kwargs)
    _check(func, x)
    names = ("a", "mode", "nonlinearity", "generator")
    opts = {"a": 0, "mode": "fan_in", "nonlinearity": "leaky_relu", "generator": None}
    opts.update(dict(zip(names, rest, strict=False)))
    opts.update(kwargs)
    stand_in = torch.empty(tuple(x.shape), device="meta")
    fan = _INIT._calculate_correct_fan(stand_in, opts["mode"])
    gain = _INIT.calculate_gain(opts["nonlinearity"], opts["a"])
    bound = math.sqrt(3.0) * gain / math.sqrt(fan) if fan else 0.0
    with torch.no_grad():
        x.uniform_(-bound, bound, generator=opts["generator"])
    return x


def init_materialised(func: Any, args: tuple, kwargs: dict) -> DTensor:
    """Materialised route: the whole tensor on every rank, each keeps its piece."""
    x, rest, kwargs = _split(func, args, kwargs)
    _check(func, x)
    spec = x._spec
    full = torch.empty(tuple(x.shape), dtype=x.dtype, device=x._local.device)
    with torch.no_grad():
        func(full, *rest, **kwargs)
        x._local.copy_(full[shard_slices(tuple(spec.shape), spec.placements, spec.mesh)])
    return x


def init_trunc_normal(func: Any, args: tuple, kwargs: dict) -> DTensor:
    """``trunc_normal_``: inverse-CDF sampling from offset-based uniforms -- a uniform draw
    between the normal CDF at ``a`` and at ``b``, mapped back through the inverse CDF (the
    standard method, and torch's)."""
    x, rest, kwargs = _split(func, args, kwargs)
    _check(func, x)
    names = ("mean", "std", "a", "b", "generator")
    opts = {"mean": 0.0, "std": 1.0, "a": -2.0, "b": 2.0, "generator": None}
    opts.update(dict(zip(names, rest, strict=False)))
    opts.update(kwargs)
    if opts["generator"] is not None:
        return init_materialised(func, (x,), opts)
    mean, std, a, b = (float(opts[k]) for k in ("mean", "std", "a", "b"))

    def cdf(v: float) -> float:
        return (1.0 + math.erf(v / math.sqrt(2.0))) / 2.0

    lo, hi = cdf((a - mean) / std), cdf((b - mean) / std)
    spec = x._spec
    shape, offset = spec.local_shape_and_offset()
    u = uniform_block(tuple(spec.shape), shape, offset, torch.float64, x._local.device)
    vals = torch.special.erfinv((2 * lo - 1) + (2 * hi - 2 * lo) * u)
    vals = (vals * (std * math.sqrt(2.0)) + mean).clamp(a, b)
    with torch.no_grad():
        x._local.copy_(vals.to(x._local.dtype))
    return x


def _dtensor_route(func: Any, route: Any) -> Any:
    """Wrap an initialiser that torch does not dispatch: DTensors take ``route``."""
    if getattr(func, "_hp_dtensor_init", False):
        return func

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        tensor = args[0] if args else kwargs.get("tensor")
        if type(tensor) is DTensor or isinstance(tensor, DTensor):
            return route(func, args, kwargs)
        return func(*args, **kwargs)

    wrapper._hp_dtensor_init = True  # type: ignore[attr-defined]
    return wrapper


def install() -> None:
    """Wrap the materialised initialisers in ``torch.nn.init`` (idempotent). Code that
    imported one by name before hyperpar was imported keeps torch's original."""
    for name in _MATERIALISED:
        func = getattr(_INIT, name, None)
        if func is not None:
            setattr(_INIT, name, _dtensor_route(func, init_materialised))
    _INIT.trunc_normal_ = _dtensor_route(_INIT.trunc_normal_, init_trunc_normal)


install()
