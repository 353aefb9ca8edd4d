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

from typing import Any

import torch
from torch import nn

from hyperpar.moe.placement import ExpertPlacement, expert_weight_placements
from hyperpar.moe.styles import (
    ExpertParallelLayout,
    ExpertTensorParallelLayout,
    TensorParallelLayout,
)
from hyperpar.parallel.styles import ParallelStyle
from hyperpar.platform import get_platform
from hyperpar.torch.moe import dispatch as _dispatch
from hyperpar.torch.moe.dispatch import combine, dispatch, plan_dispatch
from hyperpar.torch.parallel._comm import copy_to_region
from hyperpar.torch.parallel.style import _distribute_param, _identity, _LocalForward

__all__ = ["ExpertParallel", "ExpertTensorParallel", "TensorParallel"]


class _TorchExperts(ParallelStyle):
    """torch's mechanics for the neutral expert-style layouts (:mod:`hyperpar.moe.styles`)."""

    def _own_params(self, module: nn.Module) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in module._parameters.items() if p is not None]

    def _param_placements(self, module: Any, owner: Any, name: str) -> Any:
        if owner is not module:
            return None
        param = module._parameters.get(name)
        return None if param is None else expert_weight_placements(self._style, name, param.dim())

    def _shard_param(self, module: nn.Module, name: str, mesh: Any,
                     placements: tuple[Any, ...]) -> None:
        _distribute_param(module, name, mesh, placements, self.src_data_rank)

    def _reduce(self, y: torch.Tensor, tp_group: Any) -> torch.Tensor:
        if not self.reduce_output or get_platform().world_size(tp_group) == 1:
            return y
        from hyperpar.torch.parallel._comm import _Reduce

        return _Reduce.apply(y.contiguous(), "sum", tp_group)

    def _install_dispatch(self, module: nn.Module, placement: ExpertPlacement, ep_group: Any,
                          tp_group: Any, dim: int | None) -> None:
        style = self
        plans: list[Any] = []  # one per forward in flight (nested/recomputed forwards stack)

        def before(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if len(args) < 2:
                raise TypeError(f"{style._style}: the experts are called as "
                                f"experts(routed_input, num_tokens_per_expert); got {len(args)} "
                                f"positional argument(s)")
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

        _LocalForward([(module, n, _identity) for n, _ in self._own_params(module)], before,
                      after).install(module)
        _dispatch._DISPATCHERS[0] += 1  # router-score errors now travel with the count exchange

    def _install_tensor_parallel(self, module: nn.Module, group: Any) -> None:
        style = self

        def before(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            return (copy_to_region(args[0], group), *args[1:]), kwargs

        def after(mod: nn.Module, y: torch.Tensor, saved: dict) -> torch.Tensor:
            return style._reduce(y, group)

        _LocalForward([(module, n, _identity) for n, _ in self._own_params(module)], before,
                      after).install(module)


class ExpertParallel(ExpertParallelLayout, _TorchExperts):
    __doc__ = ExpertParallelLayout.__doc__


class ExpertTensorParallel(ExpertTensorParallelLayout, _TorchExperts):
    __doc__ = ExpertTensorParallelLayout.__doc__


class TensorParallel(TensorParallelLayout, _TorchExperts):
    __doc__ = TensorParallelLayout.__doc__
