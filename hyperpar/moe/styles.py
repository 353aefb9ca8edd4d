"""What the expert styles do, written once: ``ExpertParallel``, ``ExpertTensorParallel`` and
``TensorParallel`` for grouped experts (torchtitan's semantics), framework-neutral.

Each framework's style class is one of these layouts mixed with that framework's mechanics
(``hyperpar/torch/moe/styles.py``, ``hyperpar_mindspore/moe_styles.py``). The layout decides
which mesh dims a style takes from the mesh given to ``parallelize_module``, what it checks
before anything changes, and the order of its steps; the mechanics supply five members:

* ``_own_params(module)``: ``[(name, parameter)]`` of the module itself (not its children);
* ``_shard_param(module, name, mesh, placements)``: replace the parameter by this rank's piece;
* ``_install_dispatch(module, placement, ep_group, tp_group, dim)``: the hooks that exchange
  counts, dispatch tokens before the forward and combine after it (``tp_group``: sum the input
  gradient over tp, and the output too where ``reduce_output``);
* ``_install_tensor_parallel(module, tp_group)``: the hooks of ``TensorParallel`` (no dispatch);
* ``_reduce(y, tp_group)``: the output all-reduce over tp.
"""

from __future__ import annotations

import zlib
from typing import Any

from hyperpar.platform import get_platform

from .errors import MoEConfigError
from .placement import ExpertPlacement, expert_weight_placements, mesh_dim_index

__all__ = ["ExpertParallelLayout", "ExpertStyleLayout", "ExpertTensorParallelLayout",
           "TensorParallelLayout"]


class ExpertStyleLayout:
    """The part every expert style shares: parameter checks, the cross-rank shape check and
    sharding every parameter with its style's placements (:func:`expert_weight_placements`)."""

    _claims = ("parameters", "forward")
    _style = ""

    #: all-reduce the output over tp (the tensor-parallel styles set it; torchtitan's: False)
    reduce_output = False

    def __init__(self, *, check_finite: bool = True) -> None:
        self.check_finite = check_finite

    def _before_apply(self, module: Any, device_mesh: Any, fqn: str) -> None:
        """No dense-TP input checks: the experts' inputs are routed rows, not activations."""

    def _check_params(self, module: Any, fqn: str) -> list[tuple[str, Any]]:
        params = self._own_params(module)
        where = fqn or type(module).__name__
        if not params:
            raise MoEConfigError(f"{self._style}: {where!r} has no parameters of its own; apply "
                                 f"it to the grouped experts module (w1, w2, w3)")
        for name, p in params:
            expert_weight_placements(self._style, name, len(p.shape))  # refuses unknown names
        return params

    def _check_same_on_every_rank(self, module: Any, group: Any) -> None:
        """One object all-gather, once, at parallelize time: the experts' parameter names and
        shapes must agree on every rank of ``group`` (a rank with other expert counts or hidden
        sizes would hang the dispatch or scatter wrong weights). The hot path then checks only
        its inputs against the weights, locally, folding the verdict into the count exchange."""
        shapes = [(n, tuple(p.shape)) for n, p in self._own_params(module)]
        sig = (len(shapes), zlib.crc32(repr(shapes).encode()), shapes[:1])
        rows = get_platform().all_gather_object(sig, group)
        if any(r[:2] != rows[0][:2] for r in rows):
            seen = "; ".join(f"rank {i}: {r[0]} parameters, first {r[2]}"
                             for i, r in enumerate(rows))
            raise MoEConfigError(
                f"{self._style}: the experts' parameters differ across ranks ({seen}); build the "
                f"same experts (num_experts, dim, hidden) on every rank")

    def _shard_experts(self, module: Any, mesh: Any) -> None:
        for name, p in self._own_params(module):
            self._shard_param(module, name, mesh,
                              expert_weight_placements(self._style, name, len(p.shape)))

    def _token_dim(self, module: Any) -> int | None:
        """The token feature size the experts take: ``w1``'s last dim when the module follows
        torchtitan's layout, else unknown (the check is skipped)."""
        w1 = dict(self._own_params(module)).get("w1")
        return int(w1.shape[-1]) if w1 is not None and len(w1.shape) == 3 else None

    def _placement(self, module: Any, ep_size: int) -> ExpertPlacement:
        return ExpertPlacement(int(self._own_params(module)[0][1].shape[0]), ep_size)


class ExpertParallelLayout(ExpertStyleLayout):
    """Experts ``Shard(0)`` over the ``ep`` mesh dim, tokens dispatched to their experts' ranks
    and combined back (torchtitan's ``ExpertParallel``). Given a 1-D mesh it uses it whole; an
    n-D mesh must name a dim ``mesh_dim`` (default ``"ep"``). ``check_finite``: refuse NaN/inf
    tokens (one pass per dispatch)."""

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
        self._check_params(module, fqn)
        self._placement(module, mesh.size(0))

    def _apply(self, module: Any, device_mesh: Any) -> Any:
        ep_mesh = self._own_mesh(device_mesh)
        self._check_params(module, "")
        placement = self._placement(module, ep_mesh.size(0))
        group = ep_mesh.get_group(0)
        self._check_same_on_every_rank(module, group)
        self._shard_experts(module, ep_mesh)
        self._install_dispatch(module, placement, group, None, self._token_dim(module))
        return module


class ExpertTensorParallelLayout(ExpertStyleLayout):
    """Experts ``Shard(0)`` over ``ep`` and their hidden dim over ``tp`` on a 2-D ``(ep, tp)``
    mesh (torchtitan's ``ExpertTensorParallel``); tokens dispatched over ep.
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
        self._check_params(module, fqn)
        self._placement(module, mesh.size(0))

    def _apply(self, module: Any, device_mesh: Any) -> Any:
        mesh = self._own_mesh(device_mesh)
        self._check_params(module, "")
        placement = self._placement(module, mesh.size(0))
        ep_group, tp_group = mesh.get_group(0), mesh.get_group(1)
        self._check_same_on_every_rank(module, ep_group)
        self._check_same_on_every_rank(module, tp_group)
        self._shard_experts(module, mesh)
        self._install_dispatch(module, placement, ep_group, tp_group, self._token_dim(module))
        return module


class TensorParallelLayout(ExpertStyleLayout):
    """Grouped experts tensor-parallel (torchtitan's ``TensorParallel`` for ``GroupedExperts``):
    every expert on every rank, ``w1``/``w3`` ``Shard(1)`` and ``w2`` ``Shard(2)`` over the tp
    mesh. The input gradient is summed over tp; ``reduce_output=False`` (torchtitan's) leaves
    the output as this rank's partial sum."""

    _style = "TensorParallel"

    def __init__(self, *, reduce_output: bool = False) -> None:
        super().__init__()
        self.reduce_output = reduce_output

    def _check_mesh(self, module: Any, fqn: str, mesh: Any) -> None:
        self._check_params(module, fqn)

    def _apply(self, module: Any, device_mesh: Any) -> Any:
        self._check_params(module, "")
        group = device_mesh.get_group(0)
        self._check_same_on_every_rank(module, group)
        self._shard_experts(module, device_mesh)
        self._install_tensor_parallel(module, group)
        return module
