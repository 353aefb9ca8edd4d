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

import zlib
from typing import Any

import numpy as np
from mindspore import Parameter, Tensor, nn

from hyperpar.dtensor.placement import Shard, chunk_bounds
from hyperpar.moe.errors import MoEConfigError
from hyperpar.moe.placement import ExpertPlacement, expert_weight_placements, mesh_dim_index
from hyperpar.parallel.driver import StyleBase
from hyperpar.parallel.spec import Comm
from hyperpar.platform import get_platform

from .comm import Boundary
from .graph import refuse_graph_mode
from .moe import _DISPATCHERS, combine, dispatch, plan_dispatch
from .param_readback import attach_full_tensor
from .platform import SHARD_PLACEMENTS

__all__ = ["ExpertParallel", "ExpertTensorParallel", "TensorParallel"]

#: identity forward, gradient summed over tp (every tp rank computes a partial input gradient)
_COPY_TO_TP = Comm("none", "all_reduce")
#: the tp ranks' partial outputs summed forward; the gradient is replicated already
_REDUCE_TP = Comm("all_reduce", "none")


#: why the expert styles do not compile
_PYNATIVE_ONLY = ("the dispatch reads the token counts on the host (its all-to-all split sizes "
                  "are host ints) and its hooks run in PyNative mode only")


def _params(cell: nn.Cell) -> list[tuple[str, Parameter]]:
    return [(n, p) for n, p in cell._params.items() if p is not None]


def _check_same_on_every_rank(style: str, cell: nn.Cell, group: Any) -> None:
    """The experts' parameter names and shapes must agree on every rank of ``group`` (one
    object all-gather at parallelize time, as on torch)."""
    sig = (len(_params(cell)),
           zlib.crc32(repr([(n, tuple(p.shape)) for n, p in _params(cell)]).encode()),
           [(n, tuple(p.shape)) for n, p in _params(cell)][:1])
    rows = get_platform().all_gather_object(sig, group)
    if any(r[:2] != rows[0][:2] for r in rows):
        seen = "; ".join(f"rank {i}: {r[0]} parameters, first {r[2]}" for i, r in enumerate(rows))
        raise MoEConfigError(
            f"{style}: the experts' parameters differ across ranks ({seen}); build the same "
            f"experts (num_experts, dim, hidden) on every rank")


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


class _ExpertStyle(StyleBase):
    _claims = ("parameters", "forward")
    _style = ""

    #: all-reduce the output over tp (the tensor-parallel styles set it; torchtitan's: False)
    reduce_output = False

    def __init__(self, *, check_finite: bool = True) -> None:
        self.check_finite = check_finite

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def _before_apply(self, module: Any, device_mesh: Any, fqn: str) -> None:
        """No dense-TP input checks: the experts' inputs are routed rows, not activations."""

    def _check_params(self, cell: nn.Cell, fqn: str) -> list[tuple[str, Parameter]]:
        params = _params(cell)
        where = fqn or type(cell).__name__
        if not params:
            raise MoEConfigError(f"{self._style}: {where!r} has no parameters of its own; apply "
                                 f"it to the grouped experts Cell (w1, w2, w3)")
        for name, p in params:
            expert_weight_placements(self._style, name, p.ndim)  # refuses unknown names
        return params

    def _shard_all(self, cell: nn.Cell, mesh: Any) -> None:
        for name, p in _params(cell):
            _shard(cell, name, mesh, expert_weight_placements(self._style, name, p.ndim),
                   self.src_data_rank)

    def _reduce(self, y: Any, tp_group: Any) -> Any:
        if not self.reduce_output or get_platform().world_size(tp_group) == 1:
            return y
        return Boundary(get_platform(), _REDUCE_TP, tp_group, f"{self._style} output")(y)


def _dim_of(cell: nn.Cell) -> int | None:
    w1 = cell._params.get("w1")
    return int(w1.shape[-1]) if w1 is not None and w1.ndim == 3 else None


def _install_dispatch(style: _ExpertStyle, cell: nn.Cell, placement: ExpertPlacement,
                      ep_group: Any, tp_group: Any, dim: int | None) -> None:
    platform = get_platform()
    plans: list[Any] = []  # one per forward in flight

    def before(_cell: nn.Cell, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if len(args) < 2:
            raise TypeError(f"{style._style}: the experts are called as experts(routed_input, "
                            f"num_tokens_per_expert); got {len(args)} positional argument(s)")
        routed_input, counts = args[0], args[1]
        plan = plan_dispatch(routed_input, counts, placement, ep_group, dim=dim,
                             check_finite=style.check_finite)
        if tp_group is not None and platform.world_size(tp_group) > 1:
            routed_input = Boundary(platform, _COPY_TO_TP, tp_group,
                                    f"{style._style} input")(routed_input)
        plans.append(plan)
        local = Tensor(np.asarray(plan.tokens_per_local_expert, dtype=counts.asnumpy().dtype))
        return (dispatch(routed_input, plan, ep_group), local, *args[2:]), kwargs

    def after(_cell: nn.Cell, args: tuple, kwargs: dict, y: Any) -> Any:
        out = combine(y, plans.pop(), ep_group)
        return out if tp_group is None else style._reduce(out, tp_group)

    platform.register_forward_pre_hook(cell, before, with_kwargs=True)
    platform.register_forward_hook(cell, after, with_kwargs=True)
    _DISPATCHERS[0] += 1
    refuse_graph_mode(cell, style._style, _PYNATIVE_ONLY)


class ExpertParallel(_ExpertStyle):
    """Experts ``Shard(0)`` over the ``ep`` mesh dim, tokens dispatched to their experts'
    ranks and combined back. A 1-D mesh is used whole; an n-D mesh must name ``mesh_dim``."""

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

    def _apply(self, module: nn.Cell, device_mesh: Any) -> nn.Cell:
        ep_mesh = self._own_mesh(device_mesh)
        params = self._check_params(module, "")
        placement = ExpertPlacement(int(params[0][1].shape[0]), ep_mesh.size(0))
        group = ep_mesh.get_group(0)
        _check_same_on_every_rank(self._style, module, group)
        self._shard_all(module, ep_mesh)
        _install_dispatch(self, module, placement, group, None, _dim_of(module))
        return module


class ExpertTensorParallel(_ExpertStyle):
    """Experts ``Shard(0)`` over ``ep`` and their hidden dim over ``tp`` on a 2-D
    ``(ep, tp)`` mesh; tokens dispatched over ep. ``reduce_output=False`` (torchtitan's): the
    output is this tp rank's partial sum."""

    _style = "ExpertTensorParallel"

    def __init__(self, *, ep_dim: str = "ep", tp_dim: str = "tp", reduce_output: bool = False,
                 check_finite: bool = True) -> None:
        super().__init__(check_finite=check_finite)
        self.ep_dim, self.tp_dim = ep_dim, tp_dim
        self.reduce_output = reduce_output

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

    def _apply(self, module: nn.Cell, device_mesh: Any) -> nn.Cell:
        mesh = self._own_mesh(device_mesh)
        params = self._check_params(module, "")
        placement = ExpertPlacement(int(params[0][1].shape[0]), mesh.size(0))
        ep_group, tp_group = mesh.get_group(0), mesh.get_group(1)
        _check_same_on_every_rank(self._style, module, ep_group)
        _check_same_on_every_rank(self._style, module, tp_group)
        self._shard_all(module, mesh)
        _install_dispatch(self, module, placement, ep_group, tp_group, _dim_of(module))
        return module


class TensorParallel(_ExpertStyle):
    """Grouped experts tensor-parallel: every expert on every rank, ``w1``/``w3`` ``Shard(1)``
    and ``w2`` ``Shard(2)`` over the tp mesh; the input gradient summed over tp;
    ``reduce_output=False`` leaves the output this rank's partial sum."""

    _style = "TensorParallel"

    def __init__(self, *, reduce_output: bool = False) -> None:
        super().__init__()
        self.reduce_output = reduce_output

    def _check_mesh(self, module: Any, fqn: str, mesh: Any) -> None:
        self._check_params(module, fqn)

    def _apply(self, module: nn.Cell, device_mesh: Any) -> nn.Cell:
        self._check_params(module, "")
        group = device_mesh.get_group(0)
        _check_same_on_every_rank(self._style, module, group)
        self._shard_all(module, device_mesh)
        platform, style = get_platform(), self

        def before(_cell: nn.Cell, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            x = args[0]
            if platform.world_size(group) > 1:
                x = Boundary(platform, _COPY_TO_TP, group, "TensorParallel input")(x)
            return (x, *args[1:]), kwargs

        def after(_cell: nn.Cell, args: tuple, kwargs: dict, y: Any) -> Any:
            return style._reduce(y, group)

        platform.register_forward_pre_hook(module, before, with_kwargs=True)
        platform.register_forward_hook(module, after, with_kwargs=True)
        refuse_graph_mode(module, self._style, "its hooks run in PyNative mode only")
        return module
