"""``ms.grad`` / ``ms.value_and_grad`` return DTensor gradients for DTensor inputs.

MindSpore's executor hands back plain tensors: the gradient of a DTensor input arrives as this
rank's local piece, without its layout. PyNative gradient calls all end in one module function,
``mindspore.ops.composite.base._pynative_func_grad_backward(fn, grad_op, weights,
grad_position, has_aux, *args)``, which returns the gradients alone (before the value, aux
outputs or ids are attached). Wrapping it re-wraps the gradients of DTensor arguments as
DTensors laid out like the argument (Partial read as Replicate), so a user's own
``ms.grad(loss, (0, 1))(x, w)`` gives what torch's ``x.grad`` would.

Only PyNative runs this function: under ``ms.jit`` or ``GRAPH_MODE`` MindSpore compiles the
gradient itself (a graph holds no DTensors), so compiled code is untouched. Installed once, when
the MindSpore DTensor is imported; a MindSpore without that function keeps plain gradients and
:func:`hyperpar_mindspore.dtensor.grad` / ``value_and_grad`` still wrap them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_ORIGINAL: list[Callable[..., Any]] = []


def _wrapping(original: Callable[..., Any], rewrap: Callable[..., Any],
              dtensor: type) -> Callable[..., Any]:
    def backward(fn: Any, grad_op: Any, weights: Any, grad_position: Any, has_aux: Any,
                 *run_args: Any) -> Any:
        out = original(fn, grad_op, weights, grad_position, has_aux, *run_args)
        if not any(isinstance(a, dtensor) for a in run_args) and not (
                isinstance(weights, dtensor) or (isinstance(weights, list | tuple)
                                                 and any(isinstance(w, dtensor)
                                                         for w in weights))):
            return out  # nothing to re-wrap: MindSpore's own result, unchanged
        position = grad_position if getattr(grad_op, "get_by_position", True) else None
        return rewrap(out, run_args, position, weights if grad_op.get_by_list else None)

    backward.__wrapped__ = original  # type: ignore[attr-defined]
    return backward


def install(rewrap: Callable[..., Any], dtensor: type) -> bool:
    """Wrap MindSpore's PyNative gradient function (once); False where this MindSpore has no
    such function (gradients then stay local pieces)."""
    if _ORIGINAL:
        return True
    try:
        from mindspore.ops.composite import base
    except ImportError:
        return False
    original = getattr(base, "_pynative_func_grad_backward", None)
    if original is None:
        return False
    _ORIGINAL.append(original)
    base._pynative_func_grad_backward = _wrapping(original, rewrap, dtensor)
    return True
