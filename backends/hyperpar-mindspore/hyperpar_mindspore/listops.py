"""Legacy primitives that take a *list* of tensors, on DTensors.

MindSpore 2.10 hands a legacy primitive's call (``Primitive.__call__`` -> ``_run_op``) to
``DTensor.__fallback__`` only when a DTensor is one of its arguments, not when it sits inside a
list argument. ``ops.stack`` / ``ops.Stack``, ``ops.addn`` / ``ops.AddN`` and ``ops.IdentityN``
take their tensors as one list, so on DTensors they would run on the local pieces and return a
plain Tensor: a silently wrong result (``Concat`` and the ``mint`` ops do reach the fallback).

:func:`install` wraps ``Primitive.__call__`` once. A call whose list argument holds a DTensor is
computed from DTensor ops that have sharding rules (stack = unsqueeze each, then cat; addn = a
chain of adds; IdentityN = its inputs), so values and gradients follow those rules; any other
primitive that gets a DTensor only inside a list and returns a plain Tensor is refused, naming
it. Calls without DTensors in a list pay one scan of their arguments. Compiled graphs
(``ms.jit`` / ``GRAPH_MODE``) never run ``Primitive.__call__``'s body, so they are untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from mindspore import Tensor, ops
from mindspore.ops.primitive import Primitive

from hyperpar.dtensor.rules import ShardingError

from .dtensor_core import DTensor, clear_grad_state

_installed: list[Callable[..., Any]] = []


def _listed_dtensor(args: Sequence[Any]) -> bool:
    """Whether some list/tuple argument holds a DTensor while no argument is one itself (a
    DTensor argument reaches ``__fallback__`` as usual)."""
    found = False
    for a in args:
        if isinstance(a, DTensor):
            return False
        if type(a) in (list, tuple) and any(isinstance(e, DTensor) for e in a):
            found = True
    return found


def _stack(prim: Primitive, tensors: Sequence[Any]) -> Any:
    axis = prim.attrs.get("axis", 0)
    return ops.cat([ops.expand_dims(t, axis) for t in tensors], axis)


def _addn(prim: Primitive, tensors: Sequence[Any]) -> Any:
    out = tensors[0]
    for t in tensors[1:]:
        out = out + t
    return out


def _identity_n(prim: Primitive, tensors: Sequence[Any]) -> Any:
    return type(tensors)(tensors)


#: primitive name -> the same result from DTensor ops with sharding rules (one list argument)
EXPRESSED: dict[str, Callable[[Primitive, Sequence[Any]], Any]] = {
    "Stack": _stack, "AddN": _addn, "IdentityN": _identity_n}


def _plain_tensor_in(out: Any) -> bool:
    items = out if isinstance(out, (list, tuple)) else (out,)
    return any(isinstance(o, Tensor) and not isinstance(o, DTensor) for o in items)


def _refusal(name: str) -> ShardingError:
    return ShardingError(
        f"MindSpore primitive {name!r} got DTensors inside a list argument and returned a plain "
        "Tensor computed from the local pieces only; hyperpar has no rule for it. Call it on "
        ".full_tensor() values (then distribute_tensor the result), or use a DTensor op with a "
        "rule (mint.cat, +, ...)")


def install() -> None:
    """Wrap ``Primitive.__call__`` (idempotent); see the module docstring."""
    if _installed:
        return
    original = Primitive.__call__

    def call(self: Primitive, *args: Any) -> Any:
        if not _listed_dtensor(args):
            return original(self, *args)
        express = EXPRESSED.get(self.name)
        if express is not None and len(args) == 1:
            return express(self, args[0])
        out = original(self, *args)
        if _plain_tensor_in(out):
            clear_grad_state()  # an error inside ms.grad must not poison the next gradient call
            raise _refusal(self.name)
        return out

    call.__wrapped__ = original  # type: ignore[attr-defined]
    Primitive.__call__ = call
    _installed.append(original)
