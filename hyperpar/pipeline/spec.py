"""Deferred layer construction: :class:`LayerSpec` and :class:`TiedLayerSpec`.

A spec records a module class and its arguments without building it, so a
:class:`~hyperpar.pipeline.PipelineModule` can construct only the layers of the local stage and
count parameters of the others without allocating them.

Framework-neutral: a spec names a ``torch.nn.Module`` or a ``mindspore.nn.Cell`` class; the
torch-only ``meta``-device build is reached through ``sys.modules`` (torch is imported by the
caller that uses it, never here).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

from hyperpar.platform import get_platform


def _short(value: Any) -> str:
    if not isinstance(value, type) and hasattr(value, "shape") and hasattr(value, "dtype"):
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
        if not _is_module_class(typename):
            raise LayerSpecTypeError(
                f"{type(self).__name__}: typename must be a module class (a subclass of "
                f"torch.nn.Module or mindspore.nn.Cell), got {_short(typename)} of type "
                f"{type(typename).__name__}. "
                f"Pass the class itself, e.g. LayerSpec(nn.Linear, 16, 16), not an instance; "
                f"plain modules and callables can be put in the layer list directly."
            )
        self.typename = typename
        self.module_args = tuple(module_args)
        self.module_kwargs = dict(module_kwargs)

    def build(self, log: bool = False) -> Any:
        """Construct the module (``log`` is accepted for DeepSpeed compatibility and ignored)."""
        return self.typename(*self.module_args, **self.module_kwargs)

    def count_parameters(self) -> int:
        """Number of trainable parameters of the built module, without allocating storage
        (torch: built on the ``meta`` device, falling back to a real build if that fails;
        MindSpore: a real build)."""
        torch = sys.modules.get("torch")
        module = None
        if torch is not None and issubclass(self.typename, torch.nn.Module):
            try:
                with torch.device("meta"):
                    module = self.build()
            except Exception:
                module = None
        return trainable_count(module if module is not None else self.build())

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
                 forward_fn: Callable[[Any, Any], Any] | None = None,
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


def _is_module_class(obj: object) -> bool:
    """A module class of the selected platform's framework (a plain type check where the
    platform has no ``is_module_class``, e.g. MindSpore's)."""
    check = getattr(get_platform(), "is_module_class", None)
    if check is not None:
        return bool(check(obj))
    return isinstance(obj, type) and hasattr(obj, "construct") and hasattr(obj, "trainable_params")


def trainable_count(module: Any) -> int:
    """Trainable parameter elements of a built module (torch ``parameters()`` with
    ``requires_grad``, MindSpore ``trainable_params()``); 0 for a plain callable."""
    if hasattr(module, "trainable_params") and not hasattr(module, "named_modules"):
        return sum(int(p.size) for p in module.trainable_params())
    params = getattr(module, "parameters", None)
    if params is None or not callable(params):
        return 0
    return sum(p.numel() for p in params() if p.requires_grad)


def get_dotted(module: Any, name: str) -> Any:
    """``module.a.b`` for ``name="a.b"``; an unknown part names what the module has."""
    obj: Any = module
    for i, part in enumerate(name.split(".")):
        if not hasattr(obj, part):
            where = ".".join(name.split(".")[:i]) or type(module).__name__
            have = [n for n, _ in obj.named_parameters(recurse=False)] + \
                [n for n, _ in obj.named_children()] if hasattr(obj, "named_children") else \
                [n for n, _ in obj.name_cells().items()] if hasattr(obj, "name_cells") else []
            raise AttributeError(f"tied_weight_attr {name!r}: {where} has no attribute {part!r}"
                                 f" (it has {have})")
        obj = getattr(obj, part)
    return obj
