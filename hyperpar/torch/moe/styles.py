"""The expert styles on torch: ``ExpertParallel``, ``ExpertTensorParallel`` and
``TensorParallel`` for grouped experts, with the semantics torchtitan's
``distributed/expert_parallel.py`` gave them.

The experts module is called as ``experts(routed_input, num_tokens_per_expert)``: rows of
``routed_input`` sorted by *global* expert id, ``num_tokens_per_expert`` one count per global
expert. Its parameters are ``(num_experts, ...)`` tensors (torchtitan's ``GroupedExperts``:
``w1``/``w3`` ``(E, hidden, dim)``, ``w2`` ``(E, dim, hidden)``).

* ``ExpertParallel()`` on an ``ep`` mesh: every parameter ``Shard(0)`` (each ep rank its block
  of experts); a forward pre-hook exchanges the counts, dispatches the tokens and groups them by
  local expert; the module runs on its local experts (``num_tokens_per_expert`` now per local
  expert); a forward hook regroups and combines, so the output has the input's rows in the
  input's order.
* ``ExpertTensorParallel()`` on a 2-D ``(ep, tp)`` mesh: experts ``Shard(0)`` over ep and their
  hidden dim over tp; dispatch over ep. The input gradient is all-reduced over tp (every tp rank
  computes a partial one); the output is each tp rank's partial sum, as in torchtitan (reduce it
  at the MoE block's output, or pass ``reduce_output=True``).
* ``TensorParallel()`` on a ``tp`` mesh: every expert on every rank, hidden dim over tp; no
  dispatch; the same input and output rule as ``ExpertTensorParallel``.

The module's forward runs on the local shards (plain tensors, swapped in differentiably, as
``ColwiseParallel`` does), so grouped GEMMs and per-expert loops need no DTensor rules;
parameters stay DTensors between forwards (``w1.placements``, ``w1.full_tensor()``).
Which rank owns which experts, the splits, the regrouping orders and the placements are the
neutral core's (:mod:`hyperpar.moe`).
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
from torch import nn

from hyperpar.moe.errors import MoEConfigError
from hyperpar.moe.placement import ExpertPlacement, expert_weight_placements, mesh_dim_index
from hyperpar.parallel.styles import ParallelStyle
from hyperpar.platform import get_platform
from hyperpar.torch.moe import dispatch as _dispatch
from hyperpar.torch.moe.dispatch import combine, dispatch, plan_dispatch
from hyperpar.torch.parallel._comm import copy_to_region
from hyperpar.torch.parallel.style import _distribute_param, _identity, _LocalForward

__all__ = ["ExpertParallel", "ExpertTensorParallel", "TensorParallel"]


def _params(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in module._parameters.items() if p is not None]


def _check_same_on_every_rank(style: str, module: nn.Module, group: Any) -> None:
    """One small all-gather, once, at parallelize time: the experts' parameter names and shapes
    must agree on every rank of ``group`` (a rank with other expert counts or hidden sizes would
    hang the dispatch or scatter wrong weights). The hot path then checks only its inputs
    against the weights, locally, folding the verdict into the count exchange."""
    params = _params(module)
    first = tuple(params[0][1].shape) if params else ()
    sig = [len(params), *(list(first[:3]) + [0] * (3 - len(first[:3]))),
           zlib.crc32(repr([(n, tuple(p.shape)) for n, p in params]).encode())]
    platform = get_platform()
    mine = torch.tensor(sig, dtype=torch.int64, device=params[0][1].device if params else None)
    n = platform.world_size(group)
    every = torch.empty(n * len(sig), dtype=torch.int64, device=mine.device)
    platform.all_gather_into_tensor(every, mine, group=group)
    rows = every.reshape(n, len(sig)).tolist()
    if any(r != rows[0] for r in rows):
        seen = "; ".join(f"rank {i}: {r[0]} parameters, first of shape {tuple(r[1:4])}"
                         for i, r in enumerate(rows))
        raise MoEConfigError(
            f"{style}: the experts' parameters differ across ranks ({seen}); build the same "
            f"experts (num_experts, dim, hidden) on every rank")


class _ExpertStyle(ParallelStyle):
    _claims = ("parameters", "forward")
    _style = ""

    #: all-reduce the output over tp (the tensor-parallel styles set it; torchtitan's: False)
    reduce_output = False

    def __init__(self, *, check_finite: bool = True) -> None:
        self.check_finite = check_finite

    def _before_apply(self, module: Any, device_mesh: Any, fqn: str) -> None:
        """No dense-TP input checks: the experts' inputs are routed rows, not activations."""

    def _param_placements(self, module: Any, owner: Any, name: str) -> Any:
        if owner is not module:
            return None
        param = module._parameters.get(name)
        return None if param is None else expert_weight_placements(self._style, name, param.dim())

    def _check_params(self, module: nn.Module, fqn: str) -> list[tuple[str, nn.Parameter]]:
        params = _params(module)
        where = fqn or type(module).__name__
        if not params:
            raise MoEConfigError(f"{self._style}: {where!r} has no parameters of its own; apply "
                                 f"it to the grouped experts module (w1, w2, w3)")
        for name, p in params:
            expert_weight_placements(self._style, name, p.dim())  # refuses unknown names
        return params

    def _shard(self, module: nn.Module, mesh: Any) -> None:
        for name, p in _params(module):
            _distribute_param(module, name, mesh, expert_weight_placements(self._style, name,
                                                                           p.dim()),
                              self.src_data_rank)

    def _reduce(self, y: torch.Tensor, tp_group: Any) -> torch.Tensor:
        if not self.reduce_output or get_platform().world_size(tp_group) == 1:
            return y
        from hyperpar.torch.parallel._comm import _Reduce

        return _Reduce.apply(y.contiguous(), "sum", tp_group)


class ExpertParallel(_ExpertStyle):
    """Experts ``Shard(0)`` over the ``ep`` mesh dim, tokens dispatched to their experts'
    ranks and combined back (torchtitan's ``ExpertParallel``). Given a 1-D mesh it uses it
    whole; an n-D mesh must name a dim ``mesh_dim`` (default ``"ep"``).
    ``check_finite``: refuse NaN/inf tokens (one ``isfinite`` pass per dispatch)."""

    _style = "ExpertParallel"

    def __init__(self, *, mesh_dim: str = "ep", check_finite: bool = True) -> None:
        super().__init__(check_finite=check_finite)
        self.mesh_dim = mesh_dim

    def _own_mesh(self, device_mesh: Any) -> Any:
        if device_mesh.ndim == 1:
            return device_mesh
        mesh_dim_index(device_mesh.mesh_dim_names, self.mesh_dim, self._style)
        return device_mesh.get_mesh(self.mesh_dim)

    def _check_mesh(self, module: Any, fqn: str, mesh: Any) -> None:
        mesh = self._own_mesh(mesh)
        params = self._check_params(module, fqn)
        ExpertPlacement(int(params[0][1].shape[0]), mesh.size(0))

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        ep_mesh = self._own_mesh(device_mesh)
        params = self._check_params(module, "")
        placement = ExpertPlacement(int(params[0][1].shape[0]), ep_mesh.size(0))
        group = ep_mesh.get_group(0)
        _check_same_on_every_rank(self._style, module, group)
        self._shard(module, ep_mesh)
        _install_dispatch(self, module, placement, group, None, _dim_of(module))
        return module


class ExpertTensorParallel(_ExpertStyle):
    """Experts ``Shard(0)`` over ``ep`` and their hidden dim over ``tp`` on a 2-D
    ``(ep, tp)`` mesh (torchtitan's ``ExpertTensorParallel``); tokens dispatched over ep.
    ``reduce_output=False`` (torchtitan's): the output is this tp rank's partial sum."""

    _style = "ExpertTensorParallel"

    def __init__(self, *, ep_dim: str = "ep", tp_dim: str = "tp", reduce_output: bool = False,
                 check_finite: bool = True) -> None:
        super().__init__(check_finite=check_finite)
        self.reduce_output = reduce_output
        self.ep_dim, self.tp_dim = ep_dim, tp_dim

    def _own_mesh(self, device_mesh: Any) -> Any:
        names = device_mesh.mesh_dim_names
        mesh_dim_index(names, self.ep_dim, self._style)
        mesh_dim_index(names, self.tp_dim, self._style)
        if tuple(names) == (self.ep_dim, self.tp_dim):
            return device_mesh
        return device_mesh[self.ep_dim, self.tp_dim]

    def _check_mesh(self, module: Any, fqn: str, mesh: Any) -> None:
        mesh = self._own_mesh(mesh)
        params = self._check_params(module, fqn)
        ExpertPlacement(int(params[0][1].shape[0]), mesh.size(0))

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        mesh = self._own_mesh(device_mesh)
        params = self._check_params(module, "")
        placement = ExpertPlacement(int(params[0][1].shape[0]), mesh.size(0))
        ep_group, tp_group = mesh.get_group(0), mesh.get_group(1)
        _check_same_on_every_rank(self._style, module, mesh.get_group(0))
        _check_same_on_every_rank(self._style, module, tp_group)
        self._shard(module, mesh)
        _install_dispatch(self, module, placement, ep_group, tp_group, _dim_of(module))
        return module


class TensorParallel(_ExpertStyle):
    """Grouped experts tensor-parallel (torchtitan's ``TensorParallel`` for ``GroupedExperts``):
    every expert on every rank, ``w1``/``w3`` ``Shard(1)`` and ``w2`` ``Shard(2)`` over the tp
    mesh. The input gradient is all-reduced over tp; ``reduce_output=False`` (torchtitan's)
    leaves the output as this rank's partial sum."""

    _style = "TensorParallel"

    def __init__(self, *, reduce_output: bool = False) -> None:
        super().__init__()
        self.reduce_output = reduce_output

    def _check_mesh(self, module: Any, fqn: str, mesh: Any) -> None:
        self._check_params(module, fqn)

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        self._check_params(module, "")
        group = device_mesh.get_group(0)
        _check_same_on_every_rank(self._style, module, group)
        self._shard(module, device_mesh)
        style = self

        def before(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            return (copy_to_region(args[0], group), *args[1:]), kwargs

        def after(mod: nn.Module, y: torch.Tensor, saved: dict) -> torch.Tensor:
            return style._reduce(y, group)

        _LocalForward([(module, n, _identity) for n, _ in _params(module)], before,
                      after).install(module)
        return module


def _dim_of(module: nn.Module) -> int | None:
    """The token feature size the experts take: ``w1``'s last dim when the module follows
    torchtitan's layout, else unknown (the check is skipped)."""
    w1 = module._parameters.get("w1")
    return int(w1.shape[-1]) if w1 is not None and w1.dim() == 3 else None


def _install_dispatch(style: _ExpertStyle, module: nn.Module, placement: ExpertPlacement,
                      ep_group: Any, tp_group: Any, dim: int | None) -> None:
    plans: list[Any] = []  # one per forward in flight (nested/recomputed forwards stack)

    def before(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if len(args) < 2:
            raise TypeError(f"{style._style}: the experts are called as experts(routed_input, "
                            f"num_tokens_per_expert); got {len(args)} positional argument(s)")
        routed_input, counts = args[0], args[1]
        plan = plan_dispatch(routed_input, counts, placement, ep_group, dim=dim,
                             check_finite=style.check_finite)
        if tp_group is not None:
            routed_input = copy_to_region(routed_input, tp_group)
        plans.append(plan)
        local_counts = torch.tensor(plan.tokens_per_local_expert, dtype=counts.dtype,
                                    device=counts.device)
        return (dispatch(routed_input, plan, ep_group), local_counts, *args[2:]), kwargs

    def after(mod: nn.Module, y: torch.Tensor, saved: dict) -> torch.Tensor:
        out = combine(y, plans.pop(), ep_group)
        return out if tp_group is None else style._reduce(out, tp_group)

    _LocalForward([(module, n, _identity) for n, _ in _params(module)], before,
                  after).install(module)
    _dispatch._DISPATCHERS[0] += 1  # router-score errors now travel with the count exchange
