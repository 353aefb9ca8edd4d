"""The expert styles on Cells: ``ExpertParallel``, ``ExpertTensorParallel`` and
``TensorParallel`` for grouped experts, with torch's semantics
(:mod:`hyperpar.torch.moe.styles`), in the same ``parallelize_module`` plans.

The experts Cell is called as ``experts(routed_input, num_tokens_per_expert)`` (rows sorted by
global expert id, one count per global expert) and holds ``(num_experts, ...)`` Parameters
(``w1``/``w3`` ``(E, hidden, dim)``, ``w2`` ``(E, dim, hidden)``). After the style, each
Parameter is this rank's piece (``full_tensor()`` bound on it, its placements recorded, as the
dense MindSpore styles leave theirs), so the Cell's ``construct`` runs unchanged on its local
experts; a forward pre-hook exchanges the counts and dispatches, a forward hook combines.

Which rank owns which experts, the placements, the splits, the regrouping orders and the status
words are the neutral core's (:mod:`hyperpar.moe`); this module only moves MindSpore tensors.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mindspore import Parameter, Tensor, nn

from hyperpar.dtensor.placement import Shard, chunk_bounds
from hyperpar.moe.placement import ExpertPlacement
from hyperpar.moe.styles import (
    ExpertParallelLayout,
    ExpertTensorParallelLayout,
    TensorParallelLayout,
)
from hyperpar.parallel.driver import StyleBase
from hyperpar.parallel.spec import Comm
from hyperpar.platform import get_platform

from .comm import Boundary
from .graph import refuse_graph_mode
from .moe import _DISPATCHERS, combine, dispatch, plan_dispatch
from .param_readback import attach_full_tensor
from .tensors import SHARD_PLACEMENTS

__all__ = ["ExpertParallel", "ExpertTensorParallel", "TensorParallel"]

#: identity forward, gradient summed over tp (every tp rank computes a partial input gradient)
_COPY_TO_TP = Comm("none", "all_reduce")
#: the tp ranks' partial outputs summed forward; the gradient is replicated already
_REDUCE_TP = Comm("all_reduce", "none")


#: why the expert styles do not compile
_PYNATIVE_ONLY = ("the dispatch reads the token counts on the host (its all-to-all split sizes "
                  "are host ints) and its hooks run in PyNative mode only")


def _shard(cell: nn.Cell, name: str, mesh: Any, placements: tuple[Any, ...],
           src_data_rank: int | None) -> None:
    """Replace ``cell.<name>`` by this rank's piece of mesh rank ``src_data_rank``'s full
    parameter laid out as ``placements`` (one per mesh dim; ``torch.chunk`` pieces)."""
    platform = get_platform()
    param = cell._params[name]
    full = Tensor(param.asnumpy())
    if src_data_rank is not None:  # mesh rank 0 along every dim, one dim after the other
        coords = np.unravel_index(src_data_rank, mesh.shape)
        for d in range(mesh.ndim):
            group = mesh.get_group(d)
            if platform.world_size(group) > 1:
                platform.broadcast(full, group.ranks[int(coords[d])], group)
    data = full.asnumpy()
    coordinate = mesh.get_coordinate()
    for d, placement in enumerate(placements):
        if isinstance(placement, Shard):
            start, length = chunk_bounds(data.shape[placement.dim], mesh.size(d), coordinate[d])
            data = np.take(data, np.arange(start, start + length), axis=placement.dim)
    new = Parameter(Tensor(np.ascontiguousarray(data)), name=param.name,
                    requires_grad=param.requires_grad)
    setattr(new, SHARD_PLACEMENTS, tuple(placements))
    new._hyperpar_full_shape = tuple(param.shape)
    attach_full_tensor(new, mesh, tuple(placements), tuple(param.shape))
    cell._params[name] = new


class _CellExperts(StyleBase):
    """MindSpore's mechanics for the neutral expert-style layouts (:mod:`hyperpar.moe.styles`)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def _own_params(self, cell: nn.Cell) -> list[tuple[str, Parameter]]:
        return [(n, p) for n, p in cell._params.items() if p is not None]

    def _shard_param(self, cell: nn.Cell, name: str, mesh: Any,
                     placements: tuple[Any, ...]) -> None:
        _shard(cell, name, mesh, placements, self.src_data_rank)

    def _reduce(self, y: Any, tp_group: Any) -> Any:
        if not self.reduce_output or get_platform().world_size(tp_group) == 1:
            return y
        return Boundary(get_platform(), _REDUCE_TP, tp_group, f"{self._style} output")(y)

    def _install_dispatch(self, cell: nn.Cell, placement: ExpertPlacement, ep_group: Any,
                          tp_group: Any, dim: int | None) -> None:
        platform, style = get_platform(), self
        plans: list[Any] = []  # one per forward in flight

        def before(_cell: nn.Cell, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if len(args) < 2:
                raise TypeError(f"{style._style}: the experts are called as "
                                f"experts(routed_input, num_tokens_per_expert); got {len(args)} "
                                f"positional argument(s)")
            routed_input, counts = args[0], args[1]
            plan = plan_dispatch(routed_input, counts, placement, ep_group, dim=dim,
                                 check_finite=style.check_finite)
            if tp_group is not None and platform.world_size(tp_group) > 1:
                routed_input = Boundary(platform, _COPY_TO_TP, tp_group,
                                        f"{style._style} input")(routed_input)
            plans.append(plan)
            local = Tensor(np.asarray(plan.tokens_per_local_expert,
                                      dtype=counts.asnumpy().dtype))
            return (dispatch(routed_input, plan, ep_group), local, *args[2:]), kwargs

        def after(_cell: nn.Cell, args: tuple, kwargs: dict, y: Any) -> Any:
            out = combine(y, plans.pop(), ep_group)
            return out if tp_group is None else style._reduce(out, tp_group)

        platform.register_forward_pre_hook(cell, before, with_kwargs=True)
        platform.register_forward_hook(cell, after, with_kwargs=True)
        _DISPATCHERS[0] += 1
        refuse_graph_mode(cell, style._style, _PYNATIVE_ONLY)

    def _install_tensor_parallel(self, cell: nn.Cell, group: Any) -> None:
        platform, style = get_platform(), self

        def before(_cell: nn.Cell, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            x = args[0]
            if platform.world_size(group) > 1:
                x = Boundary(platform, _COPY_TO_TP, group, "TensorParallel input")(x)
            return (x, *args[1:]), kwargs

        def after(_cell: nn.Cell, args: tuple, kwargs: dict, y: Any) -> Any:
            return style._reduce(y, group)

        platform.register_forward_pre_hook(cell, before, with_kwargs=True)
        platform.register_forward_hook(cell, after, with_kwargs=True)
        refuse_graph_mode(cell, style._style, "its hooks run in PyNative mode only")


class ExpertParallel(ExpertParallelLayout, _CellExperts):
    __doc__ = ExpertParallelLayout.__doc__


class ExpertTensorParallel(ExpertTensorParallelLayout, _CellExperts):
    __doc__ = ExpertTensorParallelLayout.__doc__


class TensorParallel(TensorParallelLayout, _CellExperts):
    __doc__ = TensorParallelLayout.__doc__
