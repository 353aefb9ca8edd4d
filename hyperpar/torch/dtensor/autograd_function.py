"""Custom ``torch.autograd.Function``s applied to DTensors, as torch's DTensor runs them.

hyperpar records autograd on a DTensor's *local* tensor, and ``Function.apply`` never reaches
``__torch_function__``: applied to the wrappers directly, a Function's output would have no
path back to the inputs' local tensors (its gradient silently lost). So ``Function.apply`` is
wrapped once, when hyperpar's torch DTensor is imported: a call with no DTensor among its
positional arguments goes straight to torch's ``apply`` (one scan of the arguments); a call
with DTensors runs the user's Function inside :class:`_OnLocals`, an autograd Function over the
local tensors:

- forward: each DTensor argument is handed to the user's ``forward`` as a DTensor of the same
  mesh, placements and shape around its (detached) local tensor; DTensor outputs leave as their
  local tensors and are wrapped again, with their placements, for the caller;
- ``ctx`` is a proxy of the real context: ``save_for_backward`` / ``saved_tensors``,
  ``mark_dirty``, ``mark_non_differentiable`` and ``needs_input_grad`` see DTensors where the
  user passed DTensors, every other attribute is the real context's;
- backward: each output gradient reaches the user's ``backward`` as a DTensor laid out as the
  output (Partial read as Replicate: hyperpar's gradient convention); a DTensor gradient
  returned for a DTensor input is redistributed to that input's gradient layout (a Partial one
  is summed over its mesh dims) and handed back as its local tensor.

What is not handled raises :class:`CustomFunctionError` instead of losing the gradient:
DTensors in keyword arguments or nested in lists, a plain tensor returned as the gradient of a
DTensor input, forward-mode AD (``jvp``), and DTensors under ``torch.func`` transforms. Under
``torch.compile`` the call is left to torch (Dynamo traces custom Functions itself).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from hyperpar.dtensor.placement import grad_placements_of
from hyperpar.torch.dtensor._ops.dispatch import CustomFunctionError
from hyperpar.torch.dtensor.api import DTensor, DTensorSpec, _wrap

__all__ = ["install"]

_Function = torch.autograd.Function
_compiling = torch.compiler.is_compiling
_functorch_active = torch._C._are_functorch_transforms_active
# torch's own apply, as its raw descriptor: a Python classmethod on some torch versions, a C
# one on others (2.14); bound to the calling class at each call
_ORIGINAL = inspect.getattr_static(_Function, "apply")
# forward receives its call's specs through this stack (forward runs inside apply, nested
# custom Functions push their own)
_PENDING: list[_Call] = []


class _Call:
    """One application: the user's Function, the DTensor arguments' specs by position, the
    detached locals handed to the user (to map ``mark_dirty`` back) and the output specs."""

    __slots__ = ("fn", "in_specs", "originals", "out_specs", "saved_specs")

    def __init__(self, fn: type, in_specs: dict[int, DTensorSpec]) -> None:
        self.fn = fn
        self.in_specs = in_specs
        self.originals: dict[int, torch.Tensor] = {}   # id(detached local) -> input tensor
        self.out_specs: list[DTensorSpec | None] = []
        self.saved_specs: list[DTensorSpec | None] = []


class _Ctx:
    """The user's view of the context: DTensors in, DTensors out; the rest is the real one."""

    __slots__ = ("_ctx", "_call")

    def __init__(self, ctx: Any, call: _Call) -> None:
        object.__setattr__(self, "_ctx", ctx)
        object.__setattr__(self, "_call", call)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ctx, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._ctx, name, value)

    def save_for_backward(self, *tensors: Any) -> None:
        self._call.saved_specs = [t._spec if isinstance(t, DTensor) else None for t in tensors]
        self._ctx.save_for_backward(*(_local(t) for t in tensors))

    @property
    def saved_tensors(self) -> tuple[Any, ...]:
        saved = self._ctx.saved_tensors
        return tuple(t if s is None or t is None else _wrap(t, s)
                     for t, s in zip(saved, self._call.saved_specs, strict=True))

    def mark_dirty(self, *tensors: Any) -> None:
        back = self._call.originals
        self._ctx.mark_dirty(*(back.get(id(_local(t)), _local(t)) for t in tensors))

    def mark_non_differentiable(self, *tensors: Any) -> None:
        self._ctx.mark_non_differentiable(*(_local(t) for t in tensors))

    def save_for_forward(self, *tensors: Any) -> None:
        raise CustomFunctionError(
            f"{self._call.fn.__name__}: forward-mode AD (save_for_forward / jvp) of a custom "
            f"Function over hyperpar DTensors is not supported; apply it to local tensors "
            f"(hyperpar.local_map)")


def _local(t: Any) -> Any:
    return t._local if isinstance(t, DTensor) else t


class _OnLocals(torch.autograd.Function):
    """The user's Function run on the DTensor arguments' local tensors (see the module)."""

    @staticmethod
    def forward(ctx: Any, *args: Any) -> Any:  # type: ignore[override]
        call = _PENDING.pop()
        user_ctx = _Ctx(ctx, call)
        wrapped = list(args)
        for i, spec in call.in_specs.items():
            local = args[i].detach()  # forward runs without grad: the user's ops record nothing
            call.originals[id(local)] = args[i]
            wrapped[i] = _wrap(local, spec)
        fn = call.fn
        if _uses_setup_context(fn):
            out = fn.forward(*wrapped)
            fn.setup_context(user_ctx, tuple(wrapped), out)
        else:
            out = fn.forward(user_ctx, *wrapped)
        ctx._hyperpar_call = call
        if isinstance(out, tuple):
            call.out_specs = [o._spec if isinstance(o, DTensor) else None for o in out]
            return tuple(_local(o) for o in out)
        call.out_specs = [out._spec if isinstance(out, DTensor) else None]
        return _local(out)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:  # type: ignore[override]
        call: _Call = ctx._hyperpar_call
        wrapped = []
        for g, spec in zip(grads, call.out_specs, strict=True):
            if spec is None or g is None:
                wrapped.append(g)
                continue
            placements = grad_placements_of(spec.placements)
            if placements != spec.placements:
                spec = DTensorSpec(spec.mesh, placements, spec.shape)
            wrapped.append(_wrap(g, spec))
        result = call.fn.backward(_Ctx(ctx, call), *wrapped)
        if not isinstance(result, tuple):
            result = (result,)
        out = []
        for i, g in enumerate(result):
            spec = call.in_specs.get(i)
            if spec is None or g is None:
                out.append(_local(g))
            elif isinstance(g, DTensor):
                out.append(g._redistributed_local(grad_placements_of(spec.placements)))
            else:
                raise CustomFunctionError(
                    f"{call.fn.__name__}.backward returned a plain {type(g).__name__} as the "
                    f"gradient of argument {i}, a DTensor {list(spec.placements)}: return a "
                    f"DTensor (e.g. DTensor.from_local(grad, mesh, placements)) so its layout "
                    f"is known")
        return tuple(out)


def _original_apply(cls: type, *args: Any, **kwargs: Any) -> Any:
    return _ORIGINAL.__get__(None, cls)(*args, **kwargs)


def _uses_setup_context(fn: type) -> bool:
    return fn.setup_context is not _Function.setup_context  # type: ignore[comparison-overlap]


def _apply(cls: type, *args: Any, **kwargs: Any) -> Any:
    """``Function.apply`` for every Function class: DTensor arguments run through
    :class:`_OnLocals`, anything else is torch's own ``apply``."""
    for a in args:
        if isinstance(a, DTensor):
            break
    else:
        return _original_apply(cls, *args, **kwargs)
    if cls is _OnLocals or _compiling():
        return _original_apply(cls, *args, **kwargs)
    if _functorch_active():
        raise CustomFunctionError(
            f"{cls.__name__}.apply on hyperpar DTensors under a torch.func transform is not "
            f"supported; apply it to local tensors (hyperpar.local_map)")
    if kwargs:
        if _uses_setup_context(cls):  # torch binds keywords to forward's parameters there
            bound = inspect.signature(cls.forward).bind(*args, **kwargs)
            bound.apply_defaults()
            args, kwargs = tuple(bound.args), {}
        elif any(isinstance(v, DTensor) for v in kwargs.values()):
            raise CustomFunctionError(
                f"{cls.__name__}.apply: DTensors passed by keyword are not supported; pass "
                f"them positionally")
    in_specs = {i: a._spec for i, a in enumerate(args) if isinstance(a, DTensor)}
    call = _Call(cls, in_specs)
    _PENDING.append(call)
    try:
        out = _original_apply(_OnLocals, *(_local(a) for a in args), **kwargs)
    finally:
        if _PENDING and _PENDING[-1] is call:  # forward never ran (apply raised first)
            _PENDING.pop()
    if isinstance(out, tuple):
        return tuple(o if s is None else _wrap(o, s)
                     for o, s in zip(out, call.out_specs, strict=True))
    spec = call.out_specs[0]
    return out if spec is None else _wrap(out, spec)


def install() -> None:
    """Wrap ``torch.autograd.Function.apply`` (once per process)."""
    if getattr(inspect.getattr_static(_Function, "apply"), "__func__", None) is _apply:
        return
    _Function.apply = classmethod(_apply)  # type: ignore[method-assign,assignment]
