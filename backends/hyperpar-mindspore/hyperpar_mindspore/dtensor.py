"""DTensor on MindSpore: the user-facing module. The class (``DTensor``, ``distribute_tensor``)
is :mod:`hyperpar_mindspore.dtensor_core`'s; importing this module puts the op layer under it.

Every PyNative op on a DTensor reaches ``DTensor.__fallback__`` as an ``OpCall``; the op is
mapped to a neutral name (:mod:`hyperpar_mindspore.opnames`), the framework-neutral rule of
:mod:`hyperpar.dtensor.rules` says how to lay out the inputs and what the output is, the inputs
are redistributed (differentiably), and the op runs on the local tensors under
``NoFallbackGuard`` (:mod:`.dispatch`). Legacy primitives taking a list of tensors
(:mod:`.listops`) and MindSpore's Python-composed losses (:mod:`.lossops`) are routed too.
``ms.grad`` returns plain local tensors: :func:`grad` and :func:`value_and_grad` here wrap the
gradients of DTensor inputs back into DTensors, and ``ms.grad`` itself is wrapped to do the same
(:mod:`.gradwrap`).

Layering: this module is the top of the op layer; :mod:`.dtensor_core` and the ops
(:mod:`.dispatch`, :mod:`.listops`, :mod:`.lossops`) import only down, and nothing here is
imported by them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mindspore as ms

from hyperpar.dtensor.placement import Partial, Replicate, Shard

from . import dispatch, gradwrap, listops, lossops
from .dtensor_core import DTensor, _rewrap, clear_grad_state, distribute_tensor, install_dispatch


def grad(fn: Callable[..., Any], grad_position: Any = 0, weights: Any = None,
         has_aux: bool = False) -> Callable[..., Any]:
    """``ms.grad`` whose gradients of DTensor inputs (and DTensor weights) are DTensors laid out
    like the input (Partial read as Replicate). ``ms.grad`` itself returns the local shards."""
    inner = ms.grad(fn, grad_position, weights, has_aux)

    def run(*args: Any) -> Any:
        out = inner(*args)
        if has_aux:
            return _rewrap(out[0], args, grad_position, weights), out[1]
        return _rewrap(out, args, grad_position, weights)

    return run


def value_and_grad(fn: Callable[..., Any], grad_position: Any = 0, weights: Any = None,
                   has_aux: bool = False) -> Callable[..., Any]:
    """``ms.value_and_grad`` with DTensor gradients for DTensor inputs (see :func:`grad`)."""
    inner = ms.value_and_grad(fn, grad_position, weights, has_aux)

    def run(*args: Any) -> Any:
        value, grads = inner(*args)
        return value, _rewrap(grads, args, grad_position, weights)

    return run


__all__ = ["DTensor", "Partial", "Replicate", "Shard", "clear_grad_state", "distribute_tensor",
           "grad", "value_and_grad"]


install_dispatch(dispatch.dispatch, dispatch.getitem)
# Legacy primitives taking a list of tensors bypass __fallback__: route or refuse them (listops).
listops.install()
# ops.cross_entropy / ops.nll_loss are Python compositions: route DTensor calls whole (lossops).
lossops.install()
# ms.grad / ms.value_and_grad give DTensor gradients for DTensor arguments (PyNative; gradwrap).
gradwrap.install(_rewrap, DTensor)
