"""PyTorch's mechanics of the parallel styles (:mod:`hyperpar.parallel.styles`).

The styles themselves -- arguments, defaults, checks, which parameter gets which placement --
are written once in :mod:`hyperpar.parallel.styles` and are the same classes on every
framework; this module is what they do to an ``nn.Module``. A Linear/Embedding under
``ColwiseParallel`` or ``RowwiseParallel`` keeps its parameters as DTensors
(``weight.placements``, ``weight.full_tensor()``) but its forward runs on the *local* shards --
a forward pre-hook swaps in the local tensors (``to_local()``, differentiable, so gradients land
on the DTensor parameters) and converts the input; a forward hook restores the parameters and
converts the output. Communication happens only there, through
:mod:`hyperpar.torch.parallel._comm`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hyperpar.dtensor.errors import AlreadyParallelizedError
from hyperpar.dtensor.placement import Placement, Replicate, Shard
from hyperpar.parallel.driver import UnsupportedModuleError
from hyperpar.parallel.spec import (
    StyleSpec,
    boundary_global_shape,
    check_style_input,
    feature_lengths,
    local_range,
    param_placement,
    row_bias,
)
from hyperpar.parallel.styles import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    as_placement,
)
from hyperpar.platform import get_platform
from hyperpar.torch.parallel._comm import (
    _MEMO,
    copy_to_region,
    full_length,
    gather_ids,
    prepare_column_input,
    redistribute_boundary,
    reshard_scope,
)
from hyperpar.torch.parallel._debug_checks import (
    note_inferred_output,
    verify_dtensor_input,
)

__all__ = [
    "ColwiseParallel",
    "ParallelStyle",
    "RowwiseParallel",
    "AlreadyParallelizedError",
    "SequenceParallel",
    "UnsupportedModuleError",
    "as_placement",
]

# ---------------------------------------------------------------------------------- helpers
_DTENSOR: list[type] = []


def _dtensor_cls() -> type:
    if not _DTENSOR:
        from hyperpar.dtensor import DTensor

        _DTENSOR.append(DTensor)
    return _DTENSOR[0]


def _local_and_layout(x: Any, default: Placement, what: str
                      ) -> tuple[torch.Tensor, Placement, int | None]:
    """``(local tensor, its placement, global length along its shard dim)`` of a module input
    (``what``: the style's input, for messages): a DTensor carries its placement and shape; a
    plain tensor is taken to be laid out as ``default`` and its global length is unknown
    (``None``)."""
    if isinstance(x, _dtensor_cls()):
        p = check_style_input(x.placements, what)
        verify_dtensor_input(x.to_local())  # an inferred (even-split) length: checked once
        return x.to_local(), p, (x.shape[p.dim] if type(p) is Shard else None)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a tensor input, got {type(x).__name__}")
    return x, default, None


def _global_shape(local: torch.Tensor, placement: Placement, full: int | None,
                  mesh: Any) -> tuple[int, ...]:
    """The global shape of ``local`` laid out as ``placement`` (``full``: the global length
    along its shard dim, exchanged between ranks when not known)."""
    return boundary_global_shape(local.shape, placement, full,
                                 lambda d: full_length(local, d, mesh))


def _wrap(y: torch.Tensor, mesh: Any, placement: Placement, use_local_output: bool,
          shape: tuple[int, ...] | None = None) -> Any:
    if use_local_output:
        return y
    if shape is None:
        shape = _global_shape(y, placement, None, mesh)
    return _dtensor_cls().from_local(y, mesh, (placement,), run_check=False, shape=shape)


def _distribute_param(module: nn.Module, name: str, mesh: Any,
                      placement: Placement | tuple[Placement, ...],
                      src_data_rank: int | None) -> None:
    from hyperpar.dtensor import distribute_tensor

    param = module._parameters.get(name)
    if param is None or isinstance(param, _dtensor_cls()):
        return
    placements = placement if isinstance(placement, tuple) else (placement,)
    dt = distribute_tensor(param.detach(), mesh, placements, src_data_rank=src_data_rank)
    get_platform().set_parameter(module, name, dt)


def _distribute_params(module: nn.Module, spec: StyleSpec, kind: str, mesh: Any,
                       src_data_rank: int | None) -> None:
    """Lay out each parameter of a ``kind`` module as ``spec`` says (split dim or whole)."""
    for name in spec.param_dims[kind]:
        _distribute_param(module, name, mesh, param_placement(spec, kind, name), src_data_rank)


def replicate_params(module: nn.Module, mesh: Any, src_data_rank: int | None = 0, *,
                     recurse: bool = True) -> list[tuple[nn.Module, str]]:
    """Make every parameter of ``module`` (and its submodules unless ``recurse=False``) that is
    not a DTensor yet a replicated DTensor on ``mesh`` (any number of dims); return the
    ``(owner, name)`` of every parameter."""
    owners = []
    everywhere = (Replicate(),) * mesh.ndim
    for sub in module.modules() if recurse else (module,):
        for name in list(sub._parameters):
            if sub._parameters[name] is not None:
                _distribute_param(sub, name, mesh, everywhere, src_data_rank)
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
        # the layout each parameter had when the style sharded it (what the forward expects)
        self._layouts: dict[tuple[int, str], tuple[Placement, ...]] = {}

    def install(self, module: nn.Module) -> None:
        dtensor = _dtensor_cls()
        for owner, name, _ in self.params:
            param = owner._parameters.get(name)
            if isinstance(param, dtensor):
                self._layouts[(id(owner), name)] = tuple(param.placements)
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
            if isinstance(param, dtensor):
                want = self._layouts.get((id(owner), name))
                if (want is not None and tuple(param.placements) != want
                        and len(param.placements) == len(want)):
                    # A parameter tied in after parallelize_module (``fc.weight =
                    # embedding.weight``) may be laid out differently: re-lay it out for this
                    # forward (differentiable: the one .grad receives both uses), as torch's
                    # per-op DTensor would.
                    param = param.redistribute(param.device_mesh, want)
                local = param.to_local()
            else:
                local = param
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


# ---------------------------------------------------------------------------------- mechanics
def _colwise(style: Any, module: nn.Module, mesh: Any, kind: str) -> nn.Module:
    """ColwiseParallel's mechanics on a ``kind`` module: shard, gather the input, run the local
    forward."""
    what = f"{type(style).__name__} input"  # for messages
    group = mesh.get_group(0)
    src_default, dst = style.input_layouts[0], style.output_layouts[0]
    use_local = style.use_local_output

    spec = style.spec  # which dim of each parameter is split, what the local compute makes
    _distribute_params(module, spec, kind, mesh, style.src_data_rank)
    out_full = feature_lengths(kind, tuple(module.weight.shape))[1]  # the global shape's
    # Save an all-gathered input as its shard (gather again in backward): decided once here
    reshard = kind == "linear" and style.resolved_reshard_input()
    scopes: list[Any] = []  # the saved-tensor hooks open during this module's forward
    if kind == "linear":

        def before(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            while scopes:  # an earlier forward raised before its post-hook: close its hooks
                scopes.pop().__exit__(None, None, None)
            x = args[0]
            origin = None
            hit = _MEMO.get(group, x, src_default)
            if hit is None:
                local, src, full = _local_and_layout(x, src_default, what)
                hit, origin = prepare_column_input(local, src, mesh, full=full)
                if hit is not x:
                    _MEMO.put(group, x, src_default, hit)
            if reshard:
                scope = reshard_scope(hit, origin)
                if scope is not None:
                    scopes.append(scope)
            return (hit, *args[1:]), kwargs

    else:

        def before(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            local, src, full = _local_and_layout(args[0], src_default, what)
            return (gather_ids(local, src, mesh, full), *args[1:]), kwargs

    local_out = spec.local_output[kind]

    def after(mod: nn.Module, y: torch.Tensor, saved: dict) -> Any:
        if scopes:  # the linear has saved what it needs: later ops save as usual
            scopes.pop().__exit__(None, None, None)
        shape = None if use_local else (*y.shape[:-1], out_full)
        y = redistribute_boundary(y, local_out, dst, mesh, full=out_full)
        return _wrap(y, mesh, dst, use_local, shape)

    names = ("weight", "bias") if kind == "linear" else ("weight",)
    _LocalForward([(module, n, _identity) for n in names], before, after).install(module)
    return module


def _rowwise(style: Any, module: nn.Module, mesh: Any, kind: str) -> nn.Module:
    """RowwiseParallel's mechanics on a ``kind`` module: shard, re-lay out the input, reduce
    the partial sums."""
    what = f"{type(style).__name__} input"  # for messages
    group = mesh.get_group(0)
    src_default, dst = style.input_layouts[0], style.output_layouts[0]
    use_local = style.use_local_output
    state: dict[str, Any] = {}

    spec = style.spec
    _distribute_params(module, spec, kind, mesh, style.src_data_rank)
    if kind == "linear":
        params = [(module, "weight", _identity), (module, "bias", _hide)]
        wanted = spec.desired_input[kind]

        def before(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            local, src, full = _local_and_layout(args[0], src_default, what)
            local = redistribute_boundary(local, src, wanted, mesh, full=full)
            return (local, *args[1:]), kwargs

        bias_plan = row_bias(dst)
        bias_share = bias_plan.share(mesh.get_local_rank(0))

        def finish(mod: nn.Module, y: torch.Tensor, saved: dict) -> torch.Tensor:
            bias = saved.get((id(mod), "bias"))
            if bias is None:
                return y
            local_bias = bias.to_local() if isinstance(bias, _dtensor_cls()) else bias
            if bias_plan.grad.backward == "all_reduce":
                local_bias = copy_to_region(local_bias, group)
            if bias_share != 1.0:  # a Partial output: one rank's bias in the sum
                local_bias = local_bias * bias_share
            return y + local_bias

    else:
        params = [(module, "weight", _identity)]
        start, length = local_range(spec, kind, "weight", tuple(module.weight.shape),
                                    mesh.size(0), mesh.get_local_rank(0))

        def before(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            local, src, full = _local_and_layout(args[0], src_default, what)
            local_ids = gather_ids(local, src, mesh, full) - start
            outside = (local_ids < 0) | (local_ids >= length)
            state["outside"] = outside
            return (local_ids.masked_fill(outside, 0), *args[1:]), kwargs

        def finish(mod: nn.Module, y: torch.Tensor, saved: dict) -> torch.Tensor:
            return y

    local_out = spec.local_output[kind]

    def after(mod: nn.Module, y: torch.Tensor, saved: dict) -> Any:
        outside = state.pop("outside", None)
        if outside is not None:
            y = y.masked_fill(outside.unsqueeze(-1), 0.0)
        shape = None if use_local else tuple(y.shape)
        y = redistribute_boundary(y, local_out, dst, mesh)
        return _wrap(finish(mod, y, saved), mesh, dst, use_local, shape)

    _LocalForward(params, before, after).install(module)
    return module


def _sequence_parallel(style: Any, module: nn.Module, mesh: Any) -> nn.Module:
    """SequenceParallel's mechanics: replicate the parameters, run on the slice."""
    what = f"{type(style).__name__} input"  # for messages
    group = mesh.get_group(0)
    seq = style.sequence_sharding[0]
    use_local = style.use_local_output
    owners = replicate_params(module, mesh, style.src_data_rank)
    grad_sum = lambda local: copy_to_region(local, group)  # partial grads from the slice

    state: dict[str, Any] = {}

    def before(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if not args or not isinstance(args[0], torch.Tensor):
            return args, kwargs
        x = args[0]
        local, src, full = _local_and_layout(x, seq, what)
        if not use_local:  # the output DTensor needs the global sequence length
            d = seq.dim % local.dim()
            if isinstance(x, _dtensor_cls()):  # a DTensor knows it, whatever its layout
                state["full"] = x.shape[d]
            else:
                # A plain sequence-sharded input is taken to be split evenly, as torch
                # does: exchanging lengths would cost a collective per norm (see docs).
                even = local.shape[d] * mesh.size(0) if src == seq else local.shape[d]
                state["full"] = full if full is not None else even
                state["inferred"] = full is None and src == seq
        # ``full`` is the global length along the *input's* shard dim (Shard(0) of a
        # batch-sharded DTensor, say), which the re-layout to the sequence dim needs.
        local = redistribute_boundary(local, src, seq, mesh, full=full)
        return (local, *args[1:]), kwargs

    def after(mod: nn.Module, y: Any, saved: dict) -> Any:
        full = state.pop("full", None)
        inferred = state.pop("inferred", False)
        if not isinstance(y, torch.Tensor) or use_local:
            return y
        out = _wrap(y, mesh, seq, use_local, _global_shape(y, seq, full, mesh))
        if inferred:  # an odd sequence split unevenly: caught at the first gather
            note_inferred_output(out, mesh, seq, mod)
        return out

    _LocalForward([(o, n, grad_sum) for o, n in owners], before, after).install(module)
    return module
