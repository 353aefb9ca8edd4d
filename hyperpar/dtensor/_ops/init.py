"""``torch.nn.init`` on DTensors: every initialiser fills each rank's piece of the whole tensor.

Two routes, both without communication:

* **offset-based** (the default): ``uniform_``, ``normal_``, ``trunc_normal_``, ``kaiming_*``,
  ``xavier_*`` compute their bound from the *global* shape and draw through the DTensor's
  ``uniform_``/``normal_``, which use the counter-based generator of
  :mod:`hyperpar.dtensor.random` -- the sharded result equals that generator's one-process
  result bitwise, for any layout and world size (not torch's generator: see docs/fsdp.md).
* **materialised**: an initialiser that needs the whole tensor's values (``orthogonal_``,
  ``sparse_``, ``eye_``, ``dirac_``), or a random call given an explicit ``generator=``, runs on
  a plain tensor of the global shape on every rank (drawing from torch's generator exactly as
  one process would) and each rank keeps its piece -- bitwise equal to one process with the
  same generator state, at the cost of one full-size temporary per call.

torch routes only ``uniform_``, ``normal_``, ``constant_`` and ``kaiming_uniform_`` through
``__torch_function__``; ``kaiming_normal_``/``xavier_*``/``trunc_normal_``/``zeros_``/``ones_``
run their Python body on the DTensor (which only needs the DTensor's own ops). The
materialised four and ``trunc_normal_`` (which calls ``new_tensor``) would fail that way, so
:func:`install` wraps them in ``torch.nn.init``
(a DTensor argument takes the rule here; anything else calls torch's function unchanged).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from ..api import DTensor
from ..placement import Partial
from ..random import uniform_block
from .registry import ShardingError, register_op

_INIT = torch.nn.init

#: initialisers whose values depend on the whole tensor
_MATERIALISED = ("orthogonal_", "sparse_", "eye_", "dirac_")


def _split(func: Any, args: tuple, kwargs: dict) -> tuple[DTensor, tuple, dict]:
    if args:
        return args[0], tuple(args[1:]), dict(kwargs)
    kwargs = dict(kwargs)
    return kwargs.pop("tensor"), (), kwargs


def _check(func: Any, x: DTensor) -> None:
    if any(type(p) is Partial for p in x._spec.placements):
        raise ShardingError(f"torch.nn.init.{func.__name__} on a Partial DTensor; "
                            "redistribute it to Replicate or Shard first")


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
        shape, offset = spec.local_shape_and_offset()
        piece = full
        for d, (o, n) in enumerate(zip(offset, shape, strict=False)):
            piece = piece.narrow(d, o, n)
        x._local.copy_(piece)
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
