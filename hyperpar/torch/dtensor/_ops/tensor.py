"""Tensor plumbing on DTensors: metadata queries, autograd entry points, module support,
Python protocol (format, iterate, compare, convert to numbers)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hyperpar.dtensor.placement import grad_placements_of
from hyperpar.platform.c10d import IN_PLACE_COLLECTIVES
from hyperpar.torch.dtensor._ops.dispatch import replicated_local
from hyperpar.torch.dtensor._ops.pointwise import run_pointwise
from hyperpar.torch.dtensor._ops.registry import ShardingError, mixing_error, register_op
from hyperpar.torch.dtensor.api import DTensor, DTensorSpec, TracedDTensor, _wrap
from hyperpar.torch.dtensor.redistribute import redistribute_autograd


# ---------------------------------------------------------------------------- metadata
@register_op(torch.is_complex, torch.Tensor.is_complex, torch.is_floating_point,
             torch.Tensor.is_floating_point, torch.Tensor.element_size,
             torch.Tensor.get_device, torch.Tensor.is_pinned, torch.is_nonzero,
             torch.Tensor.data_ptr, torch.Tensor.storage_offset, raw=True)
def _local_query(func: Any, args: Sequence, kwargs: dict) -> Any:
    """Local metadata (dtype kind, device, pointers): asked of the local tensor."""
    if type(args[0]) is TracedDTensor:
        return _own(func, args, kwargs)
    return func(args[0]._local, *args[1:], **kwargs)


def _own(func: Any, args: Sequence, kwargs: dict) -> Any:
    """The answer of a DTensor made inside torch.compile about its own layout (a stand-in of
    the global shape): what Dynamo reads when such a DTensor enters another compiled call
    must match what its guards will check."""
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


@register_op(torch.Tensor.is_contiguous, raw=True)
def _is_contiguous(func, args, kwargs):
    """A DTensor is logically contiguous (its shards are laid out by the rule)."""
    if type(args[0]) is TracedDTensor:
        return _own(func, args, kwargs)
    return True


@register_op(torch.Tensor.stride, raw=True)
def _stride(func, args, kwargs):
    """Strides of the contiguous global shape."""
    if type(args[0]) is TracedDTensor:
        return _own(func, args, kwargs)
    shape = args[0]._spec.shape
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(int(s), 1)
    strides = tuple(reversed(strides))
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    return strides if dim is None else strides[dim]


@register_op(torch.numel, torch.Tensor.nelement, raw=True)
def _numel(func, args, kwargs):
    """Element count of the global shape."""
    return args[0]._spec.shape.numel()


@register_op(torch.Tensor.register_hook, raw=True)
def _register_hook(func, args, kwargs):
    """The hook runs on the local gradient, seen as a DTensor (Partial -> Replicate)."""
    self, hook = args[0], args[1] if len(args) > 1 else kwargs["hook"]
    spec = self._spec

    def local_hook(grad):
        out = hook(_wrap(grad, DTensorSpec(spec.mesh, grad_placements_of(spec.placements),
                                           spec.shape)))
        return None if out is None else out._local

    return self._local.register_hook(local_hook)


@register_op(torch.Tensor.data.__get__, raw=True)
def _data(func, args, kwargs):
    """``.data``: the local tensor's data, same layout."""
    return _wrap(args[0]._local.data, args[0]._spec)


@register_op(torch.detach, raw=True)
def _detach(func, args, kwargs):
    """``detach``: the local tensor detached, same layout."""
    return args[0].detach()


@register_op(torch.Tensor.contiguous, raw=True)
def _contiguous(func, args, kwargs):
    """``contiguous``: the local tensor made contiguous, same layout."""
    x = args[0]
    return _wrap(x._local.contiguous(), x._spec)


@register_op(torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__,
                  torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.__index__,
                  torch.Tensor.numpy, raw=True)
def _to_python(func, args, kwargs):
    """``item``/``tolist``/``bool``/``float``/``numpy``: replicate, then convert."""
    return func(replicated_local(args[0]).detach(), *args[1:], **kwargs)


# ---------------------------------------------------------------------------- autograd entry
def _grad_local(t: DTensor, g: Any) -> Any:
    if g is None:
        return None
    if not isinstance(g, DTensor):
        raise mixing_error(torch.autograd.backward, g)
    want = grad_placements_of(t._spec.placements)
    return redistribute_autograd(g._local, g._spec.mesh, g._spec.placements, want,
                                 tuple(g._spec.shape))


def _as_list(x: Any) -> list:
    if x is None:
        return []
    return [x] if isinstance(x, torch.Tensor) else list(x)


@register_op(*IN_PLACE_COLLECTIVES, raw=True)
def _c10d_on_local(func, args, kwargs):
    """``torch.distributed.all_reduce(dtensor, ...)``: reduces this rank's local tensor in place
    over the given group, as on a plain tensor; placements kept, the c10d work returned.

    torch's own DTensor refuses here (``c10d.allreduce_`` has no sharding strategy), but code
    written for it unwraps first, ``if isinstance(x, torch.distributed.tensor.DTensor): x =
    x.to_local()``, and a hyperpar DTensor is not an instance of torch's class: that code
    reaches the collective with it still wrapped (torchtitan's expert-bias update under EP x
    TP), and means its local tensor. The result is what the same code gets on torch."""
    if type(args[0] if args else kwargs.get("tensor")) is TracedDTensor:
        raise ShardingError(f"{func.__name__} on a DTensor inside torch.compile: call it on "
                            f".to_local() before the compiled region")
    if args:
        args = (args[0]._local, *args[1:])
    else:
        kwargs = {**kwargs, "tensor": kwargs["tensor"]._local}
    return func(*args, **kwargs)


@register_op(torch.autograd.backward, raw=True)
def _autograd_backward(func, args, kwargs):
    """``torch.autograd.backward`` on the local tensors (gradients laid out as the outputs)."""
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


@register_op(torch.autograd.grad, raw=True)
def _autograd_grad(func, args, kwargs):
    """``torch.autograd.grad`` on the local tensors; DTensor inputs get DTensor gradients."""
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
            g = _wrap(g, DTensorSpec(spec.mesh, grad_placements_of(spec.placements),
                                     spec.shape))
        out.append(g)
    return tuple(out)


# ---------------------------------------------------------------------------- module plumbing
@register_op(torch._has_compatible_shallow_copy_type, raw=True)
def _compatible(func, args, kwargs):
    """Module ``_apply`` support: two DTensors of one spec on one device type may swap
    ``.data``; otherwise (``to_empty`` from meta, a device move) the module makes a new
    parameter of the result, as torch does for incompatible tensors."""
    a, b = args[0], args[1]
    return (isinstance(a, DTensor) and isinstance(b, DTensor) and a._spec is b._spec
            and torch._has_compatible_shallow_copy_type(a._local, b._local))


@register_op(torch.Tensor.data.__set__, raw=True)
def _set_data(func, args, kwargs):
    """Setting ``.data`` needs a DTensor of the same spec (mesh, placements, shape)."""
    self, value = args[0], args[1]
    if not isinstance(value, DTensor) or value._spec is not self._spec:
        raise ShardingError(
            "setting .data of a DTensor needs a DTensor with the same mesh, placements and "
            f"shape; got {type(value).__name__}")
    self._local.data = value._local


# ---------------------------------------------------------------------------- python protocol
@register_op(torch.Tensor.__format__, raw=True)
def _format(func, args, kwargs):
    """``format(dt, spec)``: the repr, or the full value formatted."""
    return repr(args[0]) if not args[1] else format(replicated_local(args[0]).detach(), args[1])


@register_op(torch.Tensor.__iter__, raw=True)
def _iter(func, args, kwargs):
    """Iterating a DTensor iterates ``unbind(0)``."""
    return iter(args[0].unbind(0))


@register_op(torch.equal, torch.Tensor.equal, torch.allclose, torch.Tensor.allclose,
                  torch.isclose, torch.Tensor.isclose, raw=True)
def _compare(func, args, kwargs):
    """``equal``/``allclose`` compare full values; ``isclose`` is elementwise."""
    a, b = args[0], args[1]
    if not (isinstance(a, DTensor) and isinstance(b, DTensor)):
        raise mixing_error(func, b if isinstance(a, DTensor) else a)
    if func in (torch.isclose, torch.Tensor.isclose):
        return run_pointwise(func, args, kwargs, "other", False)
    return func(replicated_local(a), replicated_local(b), *args[2:], **kwargs)
