"""Which input or output of a module each ``PrepareModuleInput`` / ``PrepareModuleOutput``
layout applies to, written once for every framework (imports none): the walk over positional
inputs, keyword inputs and outputs, and its checks and messages.

A framework supplies the tensor mechanics only: ``convert(value, layout, desired, what)``
re-lays out one tensor (its boundary collectives, a DTensor or a local result), and
``tensor`` is its tensor type. :func:`entries` lists every
``(what, layout, desired)`` a style converts, so a framework can build its boundaries once when
the style is applied; :func:`check_entries` refuses a layout without a desired layout then, on
every rank, before any forward runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hyperpar.dtensor.placement import Placement

__all__ = ["Convert", "check_entries", "entries", "label", "prepare_inputs", "prepare_outputs"]

#: ``convert(value, layout, desired, what)``: one tensor re-laid out from ``layout`` to
#: ``desired`` (``what`` names it in errors: ``"input 0"``, ``"keyword input 'mask'"``)
Convert = Callable[[Any, Placement, Placement, str], Any]

INPUT, OUTPUT = "PrepareModuleInput", "PrepareModuleOutput"


def _what_input(i: int) -> str:
    return f"input {i}"


def _what_kwarg(key: str) -> str:
    return f"keyword input {key!r}"


def _what_output(i: int) -> str:
    return f"output {i}"


def label(what: str) -> str:
    """The style and entry a message names, from the ``what`` a ``Convert`` is given
    (``"PrepareModuleInput input 0"``, ``"PrepareModuleOutput output 1"``)."""
    return f"{OUTPUT if what.startswith('output') else INPUT} {what}"


def entries(style: Any) -> list[tuple[str, str, Placement | None, Placement | None]]:
    """``(style name, what, layout, desired)`` for every input (when ``style`` has input
    layouts) and every output (when it has output layouts) it converts or passes through."""
    out: list[tuple[str, str, Placement | None, Placement | None]] = []
    if getattr(style, "input_layouts", None) is not None:
        out += [(INPUT, _what_input(i), lay, want) for i, (lay, want) in enumerate(
            zip(style.input_layouts, style.desired_input_layouts, strict=True))]
    for key, lay in (getattr(style, "input_kwarg_layouts", None) or {}).items():
        out.append((INPUT, _what_kwarg(key), lay, style.desired_input_kwarg_layouts[key]))
    if getattr(style, "output_layouts", None) is not None:
        out += [(OUTPUT, _what_output(i), lay, want) for i, (lay, want) in enumerate(
            zip(style.output_layouts, style.desired_output_layouts, strict=True))]
    return out


def check_entries(style: Any) -> None:
    """Refuse a layout given without a desired layout (raised when the style is applied)."""
    for name, what, layout, desired in entries(style):
        if layout is not None and desired is None:
            raise ValueError(f"{name} {what}: layout {layout} given but desired layout None; "
                             f"give both (or None for both to leave it as it is)")


def _one(name: str, x: Any, layout: Placement | None, desired: Placement | None, what: str,
         convert: Convert, tensor: type | tuple[type, ...]) -> Any:
    if layout is None:
        return x
    if not isinstance(x, tensor):
        raise TypeError(f"{name} {what}: a layout ({layout}) is given but the value is a "
                        f"{type(x).__name__}, not a tensor; give None for it")
    return convert(x, layout, desired, what)  # type: ignore[arg-type]


def _each(name: str, kind: str, values: tuple, layouts: tuple, desired: tuple, got: str,
          per: str, convert: Convert, tensor: type | tuple[type, ...]) -> tuple:
    """``values`` converted one layout each (torch's rule: as many layouts as values)."""
    if len(values) != len(layouts):
        raise ValueError(f"{name}: {len(layouts)} {kind} layouts given but the module {got} "
                         f"{len(values)} {per}s; give one layout per {per} (None leaves an "
                         f"{kind} as it is)")
    return tuple(v if lay is None else _one(name, v, lay, want, f"{kind} {i}", convert, tensor)
                 for i, (v, lay, want) in enumerate(zip(values, layouts, desired, strict=True)))


def prepare_inputs(style: Any, args: tuple, kwargs: dict, convert: Convert,
                   tensor: type | tuple[type, ...]) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with each input that has a layout converted to its desired one
    (one positional layout per positional input; an absent keyword input is skipped)."""
    if style.input_layouts is not None:
        args = _each(INPUT, "input", args, style.input_layouts, style.desired_input_layouts,
                     "got", "positional input", convert, tensor)
    if style.input_kwarg_layouts:
        kwargs = dict(kwargs)
        for key, lay in style.input_kwarg_layouts.items():
            if key in kwargs:
                kwargs[key] = _one(INPUT, kwargs[key], lay,
                                   style.desired_input_kwarg_layouts[key], _what_kwarg(key),
                                   convert, tensor)
    return args, kwargs


def prepare_outputs(style: Any, outputs: Any, convert: Convert,
                    tensor: type | tuple[type, ...]) -> Any:
    """``outputs`` (one value or a tuple) with each output that has a layout converted."""
    single = not isinstance(outputs, tuple)
    out = _each(OUTPUT, "output", (outputs,) if single else outputs, style.output_layouts,
                style.desired_output_layouts, "returned", "output", convert, tensor)
    return out[0] if single else out
