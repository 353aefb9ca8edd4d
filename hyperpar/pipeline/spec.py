"""Deferred layer construction: :class:`LayerSpec` and :class:`TiedLayerSpec`.

A spec records a module class and its arguments without building it, so a
:class:`~hyperpar.pipeline.PipelineModule` can construct only the layers of the local stage and
count parameters of the others without allocating them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from hyperpar.platform import get_platform


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"Tensor(shape={tuple(value.shape)}, dtype={value.dtype})"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class LayerSpecTypeError(TypeError, RuntimeError):
    """``typename`` is not a module class. A ``TypeError`` (the Python convention) that is also a
    ``RuntimeError``, which is what DeepSpeed raises: ported ``except RuntimeError`` catches it."""


class LayerSpec:
    """``LayerSpec(typename, *module_args, **module_kwargs)``: build ``typename(*args, **kwargs)``
    later, with :meth:`build`.

    ``typename`` must be a module class (checked through the Platform); anything else raises
    :class:`LayerSpecTypeError` (both a ``TypeError`` and a ``RuntimeError``, as DeepSpeed
    documents) at creation, not deep inside a pipeline build.
    """

    def __init__(self, typename: type, *module_args: Any, **module_kwargs: Any) -> None:
        if not get_platform().is_module_class(typename):
            raise LayerSpecTypeError(
                f"{type(self).__name__}: typename must be a module class (a subclass of "
                f"torch.nn.Module), got {_short(typename)} of type {type(typename).__name__}. "
                f"Pass the class itself, e.g. LayerSpec(nn.Linear, 16, 16), not an instance; "
                f"plain modules and callables can be put in the layer list directly."
            )
        self.typename = typename
        self.module_args = tuple(module_args)
        self.module_kwargs = dict(module_kwargs)

    def build(self, log: bool = False) -> nn.Module:
        """Construct the module (``log`` is accepted for DeepSpeed compatibility and ignored)."""
        return self.typename(*self.module_args, **self.module_kwargs)

    def count_parameters(self) -> int:
        """Number of trainable parameters of the built module, without allocating storage
        (built on the ``meta`` device; falls back to a real build if that fails)."""
        try:
            with torch.device("meta"):
                module = self.build()
        except Exception:
            module = self.build()
        return sum(p.numel() for p in module.parameters() if p.requires_grad)

    def _arg_text(self) -> str:
        parts = [_short(a) for a in self.module_args]
        parts += [f"{k}={_short(v)}" for k, v in self.module_kwargs.items()]
        return ", ".join(parts)

    def __repr__(self) -> str:
        args = self._arg_text()
        return f"LayerSpec({self.typename.__name__}{', ' + args if args else ''})"


class TiedLayerSpec(LayerSpec):
    """A :class:`LayerSpec` whose weights are shared by every position with the same ``key``.

    ``forward_fn(module, input)`` (optional) replaces ``module(input)`` at this position, e.g. an
    output head that reuses an embedding matrix: ``forward_fn=lambda emb, h: h @ emb.weight.T``.
    ``tied_weight_attr`` names the parameters kept identical across the stages that hold a copy:
    broadcast from the first owning stage at build time, gradients all-reduced (summed) among the
    owning stages after each backward. As in DeepSpeed it is a string or a list of strings
    (default ``["weight"]``; stored as a list), and a dotted name such as ``"linear.weight"``
    reaches into a submodule.
    """

    def __init__(self, key: str, typename: type, *module_args: Any,
                 forward_fn: Callable[[nn.Module, Any], Any] | None = None,
                 tied_weight_attr: str | Sequence[str] = ("weight",),
                 **module_kwargs: Any) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        if not isinstance(key, str) or not key:
            raise TypeError(f"TiedLayerSpec: key must be a non-empty string, got {key!r}")
        self.key = key
        self.forward_fn = forward_fn
        attrs = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)
        if not attrs or not all(isinstance(a, str) and a for a in attrs):
            raise TypeError(f"TiedLayerSpec {key!r}: tied_weight_attr must be a name or a list of "
                            f"names like 'weight' or 'linear.weight', got {tied_weight_attr!r}")
        self.tied_weight_attr = attrs

    def __repr__(self) -> str:
        args = self._arg_text()
        extra = f", forward_fn={getattr(self.forward_fn, '__name__', self.forward_fn)}" \
            if self.forward_fn is not None else ""
        return (f"TiedLayerSpec(key={self.key!r}, {self.typename.__name__}"
                f"{', ' + args if args else ''}{extra}, tied_weight_attr={self.tied_weight_attr})")


def get_dotted(module: nn.Module, name: str) -> Any:
    """``module.a.b`` for ``name="a.b"``; an unknown part names what the module has."""
    obj: Any = module
    for i, part in enumerate(name.split(".")):
        if not hasattr(obj, part):
            where = ".".join(name.split(".")[:i]) or type(module).__name__
            have = [n for n, _ in obj.named_parameters(recurse=False)] + \
                [n for n, _ in obj.named_children()] if isinstance(obj, nn.Module) else []
            raise AttributeError(f"tied_weight_attr {name!r}: {where} has no attribute {part!r}"
                                 f" (it has {have})")
        obj = getattr(obj, part)
    return obj
