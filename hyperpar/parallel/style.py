"""Parallel styles: how one module is sharded and what happens at its boundaries.

Names, keyword arguments and defaults mirror ``torch.distributed.tensor.parallel``. The
difference is inside: a Linear/Embedding under :class:`ColwiseParallel` or
:class:`RowwiseParallel` keeps its parameters as DTensors (``weight.placements``,
``weight.full_tensor()``) but its forward runs on the *local* shards -- a forward pre-hook swaps
in the local tensors (``to_local()``, differentiable, so gradients land on the DTensor
parameters) and converts the input; a forward hook restores the parameters and converts the
output. Communication happens only there, through :mod:`hyperpar.parallel._comm`.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hyperpar.dtensor.placement import Partial, Placement, Replicate, Shard, chunk_bounds
from hyperpar.platform import get_platform

from ._comm import (
    _MEMO,
    all_gather_along,
    copy_to_region,
    redistribute_local,
    to_replicated_input,
)

__all__ = [
    "ColwiseParallel",
    "ParallelStyle",
    "PrepareModuleInput",
    "PrepareModuleInputOutput",
    "PrepareModuleOutput",
    "RowwiseParallel",
    "SequenceParallel",
    "UnsupportedModuleError",
]


class UnsupportedModuleError(TypeError):
    """A style was applied to a module type it cannot shard."""


# ---------------------------------------------------------------------------------- helpers
_LAST, _PARTIAL = Shard(-1), Partial()
_DTENSOR: list[type] = []


def _dtensor_cls() -> type:
    if not _DTENSOR:
        from hyperpar.dtensor import DTensor

        _DTENSOR.append(DTensor)
    return _DTENSOR[0]


def as_placement(p: Any) -> Placement | None:
    """Accept hyperpar placements and, by duck typing, torch's ``Shard``/``Replicate``/
    ``Partial`` (so a plan written for torch runs unchanged). ``None`` stays ``None``."""
    if p is None or isinstance(p, Placement):
        return p
    kind = type(p).__name__
    if kind in ("Shard", "_StridedShard") and hasattr(p, "dim"):
        return Shard(int(p.dim))
    if kind == "Replicate":
        return Replicate()
    if kind in ("Partial", "_Partial", "_NormPartial"):
        return Partial(str(getattr(p, "reduce_op", "sum")))
    raise TypeError(f"{p!r} is not a placement (Shard(dim), Replicate(), Partial())")


def _one_d(device_mesh: Any, style: Any) -> Any:
    if device_mesh.ndim != 1:
        raise ValueError(
            f"{type(style).__name__} needs a 1-D mesh, got {device_mesh!r}; pass the "
            f"tensor-parallel sub-mesh (mesh['tp']) or let parallelize_module pick it"
        )
    return device_mesh


def _local_and_layout(x: Any, default: Placement) -> tuple[torch.Tensor, Placement]:
    """``(local tensor, its placement)`` of a module input: a DTensor carries its placement;
    a plain tensor is taken to be laid out as ``default``."""
    if isinstance(x, _dtensor_cls()):
        if len(x.placements) != 1:
            raise ValueError(f"expected a DTensor on a 1-D mesh, got placements {x.placements}")
        return x.to_local(), x.placements[0]
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a tensor input, got {type(x).__name__}")
    return x, default


def _wrap(y: torch.Tensor, mesh: Any, placement: Placement, use_local_output: bool) -> Any:
    if use_local_output:
        return y
    return _dtensor_cls().from_local(y, mesh, (placement,), run_check=False)


def _distribute_param(module: nn.Module, name: str, mesh: Any, placement: Placement,
                      src_data_rank: int | None) -> None:
    from hyperpar.dtensor import distribute_tensor

    param = module._parameters.get(name)
    if param is None or isinstance(param, _dtensor_cls()):
        return
    dt = distribute_tensor(param.detach(), mesh, (placement,), src_data_rank=src_data_rank)
    get_platform().set_parameter(module, name, dt)


def _replicate_params(module: nn.Module, mesh: Any, src_data_rank: int | None
                      ) -> list[tuple[nn.Module, str]]:
    owners = []
    for sub in module.modules():
        for name in list(sub._parameters):
            if sub._parameters[name] is not None:
                _distribute_param(sub, name, mesh, Replicate(), src_data_rank)
                owners.append((sub, name))
    return owners


class _LocalForward:
    """Runs a module's forward on the local shards of its DTensor parameters.

    ``params`` lists ``(owner module, parameter name, transform)``; ``transform(local)``
    returns what the forward sees (``None`` hides the parameter, e.g. a row-parallel bias
    that is added after the reduction). ``before(module, args, kwargs) -> (args, kwargs)`` and
    ``after(module, output, saved) -> output`` convert the boundary tensors; ``saved`` maps
    ``(id(owner), name)`` to the original parameter.
    """

    def __init__(self, params: list[tuple[nn.Module, str, Callable[[torch.Tensor], Any]]],
                 before: Callable[..., tuple[tuple, dict]],
                 after: Callable[..., Any]) -> None:
        self.params, self.before, self.after = params, before, after
        self._stack: list[dict[tuple[int, str], Any]] = []

    def install(self, module: nn.Module) -> None:
        platform = get_platform()
        platform.register_forward_pre_hook(module, self._pre, with_kwargs=True)
        platform.register_forward_hook(module, self._post)

    def _restore(self, saved: dict[tuple[int, str], Any]) -> None:
        for owner, name, _ in self.params:
            if (id(owner), name) in saved:
                owner._parameters[name] = saved[(id(owner), name)]

    def _pre(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        dtensor = _dtensor_cls()
        while self._stack:  # an earlier forward raised before its post-hook: undo its swap
            self._restore(self._stack.pop())
        saved: dict[tuple[int, str], Any] = {}
        for owner, name, transform in self.params:
            param = owner._parameters.get(name)
            if param is None:
                continue
            saved[(id(owner), name)] = param
            local = param.to_local() if isinstance(param, dtensor) else param
            owner._parameters[name] = transform(local)
        self._stack.append(saved)
        return self.before(module, args, kwargs)

    def _post(self, module: nn.Module, args: tuple, output: Any) -> Any:
        saved = self._stack.pop()
        self._restore(saved)
        return self.after(module, output, saved)


def _identity(x: Any) -> Any:
    return x


def _hide(x: Any) -> None:
    return None


# ---------------------------------------------------------------------------------- styles
class ParallelStyle(abc.ABC):
    """How to shard one module over a 1-D device mesh. ``src_data_rank`` is the rank whose
    full parameters are scattered (``None``: every rank keeps its own chunk)."""

    src_data_rank: int | None = 0

    @abc.abstractmethod
    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        """Shard ``module`` in place over ``device_mesh`` and return it."""

    def apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        """Public spelling of :meth:`_apply`."""
        return self._apply(module, device_mesh)

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if k != "src_data_rank")
        return f"{type(self).__name__}({fields})"


class ColwiseParallel(ParallelStyle):
    """Shard a Linear's weight and bias by rows (``Shard(0)``: output features) or an
    Embedding's weight by columns (``Shard(1)``).

    Input: ``input_layouts`` (default ``Replicate()``) is made replicated -- for a Linear with
    an all-reduce of the input gradient in backward (Megatron's *f*), or an all-gather forward /
    reduce-scatter backward when the input is sequence-sharded. Output: sharded on the last dim,
    converted to ``output_layouts`` (default ``Shard(-1)``); a local tensor unless
    ``use_local_output=False``.
    """

    def __init__(self, *, input_layouts: Any = None, output_layouts: Any = None,
                 use_local_output: bool = True) -> None:
        self.input_layouts = (as_placement(input_layouts) or Replicate(),)
        self.output_layouts = (as_placement(output_layouts) or Shard(-1),)
        self.desired_input_layouts = (Replicate(),)
        self.use_local_output = use_local_output

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        mesh = _one_d(device_mesh, self)
        platform = get_platform()
        group = mesh.get_group(0)
        src_default, dst = self.input_layouts[0], self.output_layouts[0]
        use_local = self.use_local_output

        if platform.is_linear(module):
            for name in ("weight", "bias"):
                _distribute_param(module, name, mesh, Shard(0), self.src_data_rank)

            def before(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
                x = args[0]
                hit = _MEMO.get(group, x, src_default)
                if hit is None:
                    local, src = _local_and_layout(x, src_default)
                    hit = to_replicated_input(local, src, group)
                    if hit is not x:
                        _MEMO.put(group, x, src_default, hit)
                return (hit, *args[1:]), kwargs

        elif platform.is_embedding(module):
            _distribute_param(module, "weight", mesh, Shard(1), self.src_data_rank)

            def before(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
                return (_replicated_ids(args[0], src_default, group), *args[1:]), kwargs

        else:
            raise UnsupportedModuleError(
                f"ColwiseParallel supports Linear and Embedding modules (as recognised by the "
                f"{platform.name} platform), got {type(module).__name__}"
            )

        def after(mod: nn.Module, y: torch.Tensor, saved: dict) -> Any:
            y = redistribute_local(y, _LAST, dst, group)
            return _wrap(y, mesh, dst, use_local)

        names = ("weight", "bias") if platform.is_linear(module) else ("weight",)
        _LocalForward([(module, n, _identity) for n in names], before, after).install(module)
        return module


def _replicated_ids(x: Any, src: Placement, group: Any) -> torch.Tensor:
    """Token ids (no gradient) made replicated."""
    if isinstance(x, _dtensor_cls()):
        return x.full_tensor()
    if isinstance(src, Shard):
        return all_gather_along(x, src.dim, group)
    return x


class RowwiseParallel(ParallelStyle):
    """Shard a Linear's weight by columns (``Shard(1)``: input features; bias replicated) or an
    Embedding's weight by rows (``Shard(0)``: a vocabulary-parallel embedding).

    Input: ``input_layouts`` (default ``Shard(-1)``; token ids of an Embedding are made
    replicated). Output: the partial sums are all-reduced to ``output_layouts`` (default
    ``Replicate()``) or reduce-scattered to ``Shard(d)`` (sequence parallelism); a local
    tensor unless ``use_local_output=False``.
    """

    def __init__(self, *, input_layouts: Any = None, output_layouts: Any = None,
                 use_local_output: bool = True) -> None:
        self.input_layouts = (as_placement(input_layouts) or Shard(-1),)
        self.output_layouts = (as_placement(output_layouts) or Replicate(),)
        self.desired_input_layouts = (Shard(-1),)
        self.use_local_output = use_local_output

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        mesh = _one_d(device_mesh, self)
        platform = get_platform()
        group = mesh.get_group(0)
        src_default, dst = self.input_layouts[0], self.output_layouts[0]
        use_local = self.use_local_output
        state: dict[str, Any] = {}

        if platform.is_linear(module):
            _distribute_param(module, "weight", mesh, Shard(1), self.src_data_rank)
            _distribute_param(module, "bias", mesh, Replicate(), self.src_data_rank)
            self.desired_input_layouts = (Shard(-1),)
            params = [(module, "weight", _identity), (module, "bias", _hide)]

            def before(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
                local, src = _local_and_layout(args[0], src_default)
                local = redistribute_local(local, src, _LAST, group)
                return (local, *args[1:]), kwargs

            def finish(mod: nn.Module, y: torch.Tensor, saved: dict) -> torch.Tensor:
                bias = saved.get((id(mod), "bias"))
                if bias is None:
                    return y
                local_bias = bias.to_local() if isinstance(bias, _dtensor_cls()) else bias
                if isinstance(dst, Shard):  # each rank adds it to its rows only: partial grad
                    local_bias = copy_to_region(local_bias, group)
                return y + local_bias

        elif platform.is_embedding(module):
            _distribute_param(module, "weight", mesh, Shard(0), self.src_data_rank)
            self.desired_input_layouts = (Replicate(),)
            params = [(module, "weight", _identity)]
            vocab = module.weight.shape[0]
            n, rank = mesh.size(0), mesh.get_local_rank(0)
            start, length = chunk_bounds(vocab, n, rank)

            def before(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
                ids = _replicated_ids(args[0], src_default, group)
                local_ids = ids - start
                outside = (local_ids < 0) | (local_ids >= length)
                state["outside"] = outside
                return (local_ids.masked_fill(outside, 0), *args[1:]), kwargs

            def finish(mod: nn.Module, y: torch.Tensor, saved: dict) -> torch.Tensor:
                return y

        else:
            raise UnsupportedModuleError(
                f"RowwiseParallel supports Linear and Embedding modules (as recognised by the "
                f"{platform.name} platform), got {type(module).__name__}"
            )

        def after(mod: nn.Module, y: torch.Tensor, saved: dict) -> Any:
            outside = state.pop("outside", None)
            if outside is not None:
                y = y.masked_fill(outside.unsqueeze(-1), 0.0)
            y = redistribute_local(y, _PARTIAL, dst, group)
            return _wrap(finish(mod, y, saved), mesh, dst, use_local)

        _LocalForward(params, before, after).install(module)
        return module


class SequenceParallel(ParallelStyle):
    """Run a module that works position by position (norms, dropout) on this rank's slice of
    the sequence: parameters are replicated (their gradients are all-reduced), the input is
    taken as / made ``Shard(sequence_dim)``; the output is a ``Shard(sequence_dim)`` DTensor
    unless ``use_local_output=True``."""

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = False) -> None:
        self.sequence_sharding = (Shard(sequence_dim),)
        self.use_local_output = use_local_output

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        mesh = _one_d(device_mesh, self)
        group = mesh.get_group(0)
        seq = self.sequence_sharding[0]
        use_local = self.use_local_output
        owners = _replicate_params(module, mesh, self.src_data_rank)
        grad_sum = lambda local: copy_to_region(local, group)  # partial grads from the slice

        def before(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if not args or not isinstance(args[0], torch.Tensor):
                return args, kwargs
            local, src = _local_and_layout(args[0], seq)
            local = redistribute_local(local, src, seq, group)
            return (local, *args[1:]), kwargs

        def after(mod: nn.Module, y: Any, saved: dict) -> Any:
            if not isinstance(y, torch.Tensor):
                return y
            return _wrap(y, mesh, seq, use_local)

        _LocalForward([(o, n, grad_sum) for o, n in owners], before, after).install(module)
        return module


# ---------------------------------------------------------------------------------- prepare
def _convert(x: Any, layout: Placement | None, desired: Placement | None, mesh: Any,
             use_local: bool, what: str) -> Any:
    if layout is None:
        return x
    if desired is None:
        raise ValueError(f"{what}: a desired layout is required where a layout is given")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what}: expected a tensor for layout {layout!r}, got {type(x).__name__}")
    local, src = _local_and_layout(x, layout)
    y = redistribute_local(local, src, desired, mesh.get_group(0))
    return _wrap(y, mesh, desired, use_local)


def _layouts(value: Any) -> tuple[Placement | None, ...] | None:
    if value is None:
        return None
    if isinstance(value, tuple | list):
        return tuple(as_placement(v) for v in value)
    return (as_placement(value),)


def _kw_layouts(value: Any) -> dict[str, Placement | None]:
    return {k: as_placement(v) for k, v in (value or {}).items()}


class PrepareModuleInput(ParallelStyle):
    """Convert a module's inputs (positional: ``input_layouts`` -> ``desired_input_layouts``,
    one entry per argument, ``None`` passes through; keyword: the ``*_kwarg_layouts`` dicts)
    before its forward. Inputs come out as DTensors unless ``use_local_output=True``."""

    def __init__(self, *, input_layouts: Any = None, desired_input_layouts: Any = None,
                 input_kwarg_layouts: dict[str, Any] | None = None,
                 desired_input_kwarg_layouts: dict[str, Any] | None = None,
                 use_local_output: bool = False) -> None:
        self.input_layouts = _layouts(input_layouts)
        self.desired_input_layouts = _layouts(desired_input_layouts)
        self.input_kwarg_layouts = _kw_layouts(input_kwarg_layouts)
        self.desired_input_kwarg_layouts = _kw_layouts(desired_input_kwarg_layouts)
        self.use_local_output = use_local_output
        if (self.input_layouts is None) != (self.desired_input_layouts is None) or (
            self.input_layouts is not None
            and len(self.input_layouts) != len(self.desired_input_layouts)
        ):
            raise ValueError(
                f"input_layouts {self.input_layouts} and desired_input_layouts "
                f"{self.desired_input_layouts} must have the same length"
            )
        if set(self.input_kwarg_layouts) != set(self.desired_input_kwarg_layouts):
            raise ValueError(
                f"input_kwarg_layouts keys {sorted(self.input_kwarg_layouts)} and "
                f"desired_input_kwarg_layouts keys {sorted(self.desired_input_kwarg_layouts)} "
                f"must match"
            )

    def _prepare(self, args: tuple, kwargs: dict, mesh: Any) -> tuple[tuple, dict]:
        if self.input_layouts is not None:
            if len(args) < len(self.input_layouts):
                raise ValueError(
                    f"PrepareModuleInput: {len(self.input_layouts)} input layouts given but the "
                    f"module got {len(args)} positional inputs"
                )
            args = tuple(
                _convert(a, lay, want, mesh, self.use_local_output, f"input {i}")
                for i, (a, lay, want) in enumerate(
                    zip(args, self.input_layouts, self.desired_input_layouts, strict=False))
            ) + tuple(args[len(self.input_layouts):])
        if self.input_kwarg_layouts:
            kwargs = dict(kwargs)
            for key, lay in self.input_kwarg_layouts.items():
                if key in kwargs:
                    kwargs[key] = _convert(kwargs[key], lay, self.desired_input_kwarg_layouts[key],
                                           mesh, self.use_local_output, f"input {key!r}")
        return args, kwargs

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        mesh = _one_d(device_mesh, self)
        get_platform().register_forward_pre_hook(
            module, lambda mod, args, kwargs: self._prepare(args, kwargs, mesh), with_kwargs=True
        )
        return module


class PrepareModuleOutput(ParallelStyle):
    """Convert a module's outputs (a tensor or a tuple; ``None`` entries pass through) from
    ``output_layouts`` to ``desired_output_layouts`` after its forward; local tensors unless
    ``use_local_output=False``."""

    def __init__(self, *, output_layouts: Any, desired_output_layouts: Any,
                 use_local_output: bool = True) -> None:
        self.output_layouts = _layouts(output_layouts)
        self.desired_output_layouts = _layouts(desired_output_layouts)
        self.use_local_output = use_local_output
        if len(self.output_layouts) != len(self.desired_output_layouts):
            raise ValueError(
                f"output_layouts {self.output_layouts} and desired_output_layouts "
                f"{self.desired_output_layouts} must have the same length"
            )

    def _prepare(self, outputs: Any, mesh: Any) -> Any:
        single = not isinstance(outputs, tuple)
        items = (outputs,) if single else outputs
        if len(items) != len(self.output_layouts):
            raise ValueError(
                f"PrepareModuleOutput: {len(self.output_layouts)} output layouts given but the "
                f"module returned {len(items)} outputs"
            )
        out = tuple(
            _convert(o, lay, want, mesh, self.use_local_output, f"output {i}")
            for i, (o, lay, want) in enumerate(
                zip(items, self.output_layouts, self.desired_output_layouts, strict=True))
        )
        return out[0] if single else out

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        mesh = _one_d(device_mesh, self)
        get_platform().register_forward_hook(
            module, lambda mod, args, outputs: self._prepare(outputs, mesh)
        )
        return module


class PrepareModuleInputOutput(ParallelStyle):
    """:class:`PrepareModuleInput` and :class:`PrepareModuleOutput` on one module
    (``use_local_input`` is the former's ``use_local_output``)."""

    def __init__(self, *, input_layouts: Any = None, desired_input_layouts: Any = None,
                 input_kwarg_layouts: dict[str, Any] | None = None,
                 desired_input_kwarg_layouts: dict[str, Any] | None = None,
                 use_local_input: bool = False, output_layouts: Any,
                 desired_output_layouts: Any, use_local_output: bool = True) -> None:
        self.prepare_module_input = PrepareModuleInput(
            input_layouts=input_layouts, desired_input_layouts=desired_input_layouts,
            input_kwarg_layouts=input_kwarg_layouts,
            desired_input_kwarg_layouts=desired_input_kwarg_layouts,
            use_local_output=use_local_input,
        )
        self.prepare_module_output = PrepareModuleOutput(
            output_layouts=output_layouts, desired_output_layouts=desired_output_layouts,
            use_local_output=use_local_output,
        )

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        self.prepare_module_input._apply(module, device_mesh)
        self.prepare_module_output._apply(module, device_mesh)
        return module
