"""The op table, the one decorator that fills it, and what rules see and return.

Every torch function a DTensor supports has one :class:`OpEntry` in :data:`OP_TABLE`, put there
by :func:`register_op`. A *rule* (the default) is a pure function ``rule(call: OpCall) ->
Sharding`` of the input placements and shapes; :mod:`.dispatch` caches its decision and runs it.
A *raw* rule (``raw=True``) is ``rule(func, args, kwargs) -> result`` and runs the op itself
(metadata queries, random-number ops, the elementwise fast paths). An :class:`OpOverlay` holds
rules that replace table entries only inside a ``with overlay.active():`` block
(``hyperpar.parallel.loss_parallel`` is one).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from hyperpar.dtensor.placement import Partial, Placement
from hyperpar.dtensor.rules.base import (  # noqa: F401  (unshard: re-exported for the rules)
    ShardingError,  # one class for both frameworks
    unshard,
)
from hyperpar.torch.dtensor.api import DTensor, DTensorSpec

Placements = tuple[Placement, ...]
P_SUM = Partial("sum")


class MixedTensorError(RuntimeError):
    """A DTensor op got a plain (non-scalar) torch.Tensor argument."""


@dataclass
class OpCall:
    """What a rule sees: the function, its arguments, and the DTensor inputs (in argument order,
    lists flattened) with their specs."""

    func: Any
    args: tuple
    kwargs: dict
    dtensors: list[DTensor]

    @property
    def specs(self) -> list[DTensorSpec]:
        return [d._spec for d in self.dtensors]

    @property
    def mesh(self):
        return self.dtensors[0]._spec.mesh

    def arg(self, index: int, name: str, default: Any = None) -> Any:
        """Argument ``index`` if passed positionally, else keyword ``name``, else ``default``."""
        if len(self.args) > index:
            return self.args[index]
        return self.kwargs.get(name, default)


@dataclass
class Sharding:
    """A rule's decision. ``inputs``: target placements per DTensor input (``None`` keeps it);
    ``outputs``: placements of the output (a list of them for several outputs); ``shapes``: the
    global output shape(s), or ``None`` to infer them on meta tensors; ``local``: a function to
    call on the local arguments instead of the op; ``reduce_grad``: sum the gradient of
    replicated inputs over the mesh dims where the output is sharded or partial."""

    inputs: list[Placements | None]
    outputs: Placements | list[Placements]
    shapes: Any = None
    local: Callable[..., Any] | None = None
    reduce_grad: bool = True


class OpEntry:
    """One table entry: the rule, whether it is raw, and where it was defined."""

    __slots__ = ("rule", "raw", "name", "family", "doc")

    def __init__(self, rule: Callable[..., Any], raw: bool) -> None:
        self.rule = rule
        self.raw = raw
        self.name = getattr(rule, "__name__", repr(rule))
        self.family = (getattr(rule, "__module__", None) or "?").rsplit(".", 1)[-1]
        self.doc = (rule.__doc__ or "").strip().split("\n")[0]

    def __repr__(self) -> str:
        return f"OpEntry({self.family}.{self.name}{', raw' if self.raw else ''})"


#: torch function -> its entry. Filled only by :func:`register_op`.
OP_TABLE: dict[Any, OpEntry] = {}


def _flatten(funcs: Iterable[Any]) -> list[Any]:
    out: list[Any] = []
    for f in funcs:
        if isinstance(f, list | tuple):
            out.extend(_flatten(f))
        elif f is not None:  # ops missing from this torch version are passed as None
            out.append(f)
    return out


def register_op(*funcs: Any, raw: bool = False, overlay: OpOverlay | None = None
                ) -> Callable[[Callable], Callable]:
    """Register the decorated rule for every torch function in ``funcs`` (functions or lists
    of them; ``None`` is skipped).

    By default the rule is ``rule(call: OpCall) -> Sharding``; its decision is cached per
    (op, input specs, non-tensor arguments, grad mode), so it must depend only on those. With
    ``raw=True`` it is ``rule(func, args, kwargs) -> result`` and runs the op itself. With
    ``overlay=`` it goes into that overlay instead of the table. The rule needs a docstring
    (its first line is what :func:`registered_ops` and the docs show)."""

    def deco(rule: Callable) -> Callable:
        if not (rule.__doc__ or "").strip():
            raise TypeError(f"op rule {rule.__name__} needs a one-line docstring saying what "
                            "it does with the placements")
        entry = OpEntry(rule, raw or overlay is not None)
        target = OP_TABLE if overlay is None else overlay.entries
        for f in _flatten(funcs):
            target[f] = entry
        return rule

    return deco


class OpOverlay:
    """Raw rules that replace table entries only while :meth:`active` is entered. An overlay
    rule is ``rule(func, args, kwargs, under)``; ``under`` is the entry it covers (or ``None``)
    and it returns :func:`dispatch.call_entry` ``(under, func, args, kwargs)`` to defer."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.entries: dict[Any, OpEntry] = {}

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Swap this overlay's rules into :data:`OP_TABLE`; the old entries come back on exit
        (process-wide, like the table; overlays nest)."""
        saved = {f: OP_TABLE.get(f) for f in self.entries}
        for f, e in self.entries.items():
            wrapped = OpEntry(functools.partial(e.rule, under=saved[f]), True)
            wrapped.name, wrapped.family, wrapped.doc = e.name, e.family, e.doc
            OP_TABLE[f] = wrapped
        try:
            yield
        finally:
            for f, e in saved.items():
                if e is None:
                    OP_TABLE.pop(f, None)
                else:
                    OP_TABLE[f] = e


# ---------------------------------------------------------------------------- names & errors
def op_name(func: Any) -> str:
    """A readable name for a torch function (``torch.add``, ``Tensor.view``, ...)."""
    name = getattr(func, "__name__", None) or repr(func)
    if name == "__get__" and hasattr(func, "__self__"):
        name = f"Tensor.{getattr(func.__self__, '__name__', '?')} (attribute)"
    mod = getattr(func, "__module__", None) or ""
    qual = getattr(func, "__qualname__", name)
    if mod.startswith("torch.nn.functional"):
        return f"torch.nn.functional.{name}"
    if "Tensor" in qual or "TensorBase" in qual:
        return f"Tensor.{name}"
    return f"torch.{name}" if mod in ("torch", "torch._C._VariableFunctions", "") else \
        f"{mod}.{name}"


def registered_ops() -> dict[str, str]:
    """Every registered torch function name -> ``family.rule`` that handles it."""
    return {op_name(f): f"{e.family}.{e.name}" for f, e in OP_TABLE.items()}


def collect_dtensors(args: Sequence, kwargs: dict) -> list[DTensor]:
    """The DTensor arguments in order (one level of lists/tuples flattened)."""
    found = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, DTensor):
            found.append(a)
        elif type(a) in (list, tuple):
            found.extend(b for b in a if isinstance(b, DTensor))
    return found


def no_rule_error(func: Any, args: Sequence, kwargs: dict) -> ShardingError:
    """The error for an op without a rule, naming it and the input placements."""
    dts = collect_dtensors(args, kwargs)
    shown = ", ".join(f"{tuple(d._spec.shape)} {list(d._spec.placements)}" for d in dts)
    return ShardingError(
        f"hyperpar DTensor has no sharding rule for {op_name(func)} with inputs [{shown}]. "
        "Call it on .to_local() / .full_tensor(), or add a rule with "
        "hyperpar.dtensor.register_op (see docs/dtensor.md)"
    )


def mixing_error(func: Any, t: Any) -> MixedTensorError:
    """The error for a DTensor op given a plain non-scalar tensor."""
    return MixedTensorError(
        f"{op_name(func)}: got a mix of DTensor and torch.Tensor (shape {tuple(t.shape)}); "
        "convert the plain tensor with distribute_tensor or DTensor.from_local first "
        "(0-dim tensors and Python numbers are allowed)"
        ". Inside library code, the plain tensor was built from a DTensor's shape (e.g. "
        "torch.masked.var/std with mask=None build their count so): pass a mask DTensor, or "
        "call the function on .full_tensor()"
    )


def variants(name: str, *, inplace: bool = False, functional: bool = False) -> list[Any]:
    """torch.<name>, Tensor.<name>, Tensor.__<name>__ (and in-place spellings if asked)."""
    out: list[Any] = []
    if inplace:
        for n in (f"{name}_", f"__i{name}__"):
            out.append(getattr(torch.Tensor, n, None))
        if functional:
            out.append(getattr(F, f"{name}_", None))
        return [f for f in out if f is not None]
    out.append(getattr(torch, name, None))
    out.append(getattr(torch.Tensor, name, None))
    out.append(getattr(torch.Tensor, f"__{name}__", None))
    if functional:
        out.append(getattr(F, name, None))
    seen, uniq = set(), []
    for f in out:
        if f is not None and id(f) not in seen:
            seen.add(id(f))
            uniq.append(f)
    return uniq


# ---------------------------------------------------------------------------- rule helpers
