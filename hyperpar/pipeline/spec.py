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


class LayerSpec:
    """``LayerSpec(typename, *module_args, **module_kwargs)``: build ``typename(*args, **kwargs)``
    later, with :meth:`build`.

    ``typename`` must be a module class (checked through the Platform); anything else raises
    ``TypeError`` at creation, not deep inside a pipeline build.
    """

    def __init__(self, typename: type, *module_args: Any, **module_kwargs: Any) -> None:
        if not get_platform().is_module_class(typename):
            raise TypeError(
                f"{type(self).__name__}: typename must be a module class (a subclass of "
                f"torch.nn.Module), got {_short(typename)} of type {type(typename).__name__}. "
                f"Pass the class itself, e.g. LayerSpec(nn.Linear, 16, 16), not an instance; "
                f"plain modules and callables can be put in the layer list directly."
            )
        self.typename = typename
        self.module_args = tuple(module_args)
        self.module_kwargs = dict(module_kwargs)

    def build(self) -> nn.Module:
        """Construct the module."""
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
    owning stages after each backward.
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
        if isinstance(tied_weight_attr, str):
            tied_weight_attr = (tied_weight_attr,)
        self.tied_weight_attr = tuple(tied_weight_attr)

    def __repr__(self) -> str:
        args = self._arg_text()
        extra = f", forward_fn={getattr(self.forward_fn, '__name__', self.forward_fn)}" \
            if self.forward_fn is not None else ""
        return (f"TiedLayerSpec(key={self.key!r}, {self.typename.__name__}"
                f"{', ' + args if args else ''}{extra}, tied_weight_attr={self.tied_weight_attr})")
