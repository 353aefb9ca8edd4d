"""Pipelines of MindSpore Cells: :class:`PipelineModule`, a Cell holding only its stage's layers.

>>> from hyperpar.pipeline import LayerSpec, PipelineModule, initialize   # doctest: +SKIP
>>> model = PipelineModule([LayerSpec(nn.Dense, 8, 8) for _ in range(4)], loss_fn=mse,
...                        partition_method="uniform")
>>> engine, *_ = initialize(model=model, optimizer=nn.SGD(model.trainable_params(), 0.1),
...                         config={"train_micro_batch_size_per_gpu": 2,
...                                 "gradient_accumulation_steps": 4})
>>> loss = engine.train_batch(data_iter)          # on every rank

The layer list, the specs (:class:`~hyperpar.pipeline.LayerSpec`,
:class:`~hyperpar.pipeline.TiedLayerSpec`), the partitioner and the schedules are hyperpar's
framework-neutral ones, shared with torch; this module builds the Cells and ties weights. The
executor and the engine are in :mod:`hyperpar_mindspore.pipeline_engine`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from mindspore import nn

from hyperpar.pipeline.layout import resolve_stages
from hyperpar.pipeline.partition import partition_layers
from hyperpar.pipeline.spec import LayerSpec, TiedLayerSpec, get_dotted
from hyperpar.platform import get_platform

from .tensors import copy_tensor

__all__ = ["PipelineModule"]


class _Position:
    """One entry of the stage: a Cell, a tied Cell through ``forward_fn``, or a callable."""

    def __init__(self, fn: Callable[[Any], Any], cell: nn.Cell | None) -> None:
        self.fn, self.cell = fn, cell


class PipelineModule(nn.Cell):
    """``PipelineModule(layers, num_stages=None, topology=None, loss_fn=None, *,
    partition_method="parameters", group=None, mesh=None, mesh_dim=None, virtual_stages=1)``:
    the layers of this rank's stages, built from ``layers`` (``LayerSpec``, ``TiedLayerSpec``,
    Cells or plain callables), as torch's ``PipelineModule`` does, with its arguments.

    Where the stages sit is resolved as on torch (:func:`hyperpar.pipeline.layout.
    resolve_stages`): the pipeline runs along ``mesh``'s dimension ``mesh_dim`` (default
    ``"pp"``) and a ``"dp"`` dimension of that mesh holds the replicas; or ``topology=
    PipeDataParallelTopology(num_pp, num_dp)``; or ``num_stages`` divides the world into
    ``world // num_stages`` pipelines (DeepSpeed's layout); default: one pipeline over the
    world. The replicas of this rank's stage form :attr:`dp_group` (:attr:`dp_size` ranks),
    over which the engine averages gradients and losses; each replica is fed its own data.
    ``virtual_stages=v`` cuts the layers into ``num_stages * v`` stages placed round-robin
    (stage ``s`` on pipeline rank ``s % num_stages``), for the interleaved schedule.

    ``partition_method`` is ``"uniform"``, ``"parameters"``, ``"type:REGEX"`` or a list of
    boundaries. Tied weights (same ``TiedLayerSpec`` key on several stages) start from the
    first owning stage's values; the engine sums their gradients over the owning stages.
    ``construct(x)`` runs the stage chosen by :meth:`select_stage` (the first local one).
    """

    def __init__(self, layers: Sequence[Any], num_stages: int | None = None,
                 topology: Any = None, loss_fn: Callable[..., Any] | None = None, *,
                 partition_method: str | Sequence[int] = "parameters", group: Any = None,
                 mesh: Any = None, mesh_dim: str | int | None = None,
                 virtual_stages: int = 1) -> None:
        super().__init__()
        layers = list(layers)
        if not layers:
            raise ValueError("PipelineModule: the layer list is empty")
        for i, layer in enumerate(layers):
            if not (isinstance(layer, LayerSpec | nn.Cell) or callable(layer)):
                raise TypeError(f"PipelineModule: layer {i} is a {type(layer).__name__}; give "
                                f"LayerSpec/TiedLayerSpec, Cells or callables")
        layout = resolve_stages(num_stages, group=group, mesh=mesh, mesh_dim=mesh_dim,
                                topology=topology, virtual_stages=virtual_stages)
        layout.apply_to(self)
        self.parts = partition_layers(layers, self.total_stages, partition_method)
        self.loss_fn = loss_fn
        # tied keys: which pipeline ranks hold a position with the key (every rank alike)
        self.tied_owners: dict[str, list[int]] = {}
        self._tied_attrs: dict[str, list[str]] = {}
        for s in range(self.total_stages):
            for layer in layers[self.parts[s]:self.parts[s + 1]]:
                if isinstance(layer, TiedLayerSpec):
                    owners = self.tied_owners.setdefault(layer.key, [])
                    if self.stage_owner(s) not in owners:
                        owners.append(self.stage_owner(s))
                    self._tied_attrs[layer.key] = layer.tied_weight_attr
        cells: list[nn.Cell] = []
        self.tied_modules: dict[str, nn.Cell] = {}
        self._stage_positions: dict[int, list[_Position]] = {}
        for stage in self.local_stages:
            self._stage_positions[stage] = [
                self._build(layer, cells)
                for layer in layers[self.parts[stage]:self.parts[stage + 1]]]
        self._active = self.local_stages[0]
        self.stage_layers = nn.CellList(cells)
        self._tie()

    @property
    def _positions(self) -> list[_Position]:
        """The entries of the active stage (see :meth:`select_stage`)."""
        return self._stage_positions[self._active]

    def select_stage(self, stage: int) -> None:
        """Make ``construct`` run local stage ``stage`` (interleaved schedules hold several;
        the Cell is still called as a whole, so hooks on it -- fully_shard's -- run)."""
        if stage not in self._stage_positions:
            raise ValueError(f"stage {stage} is not on this rank (local stages: "
                             f"{self.local_stages})")
        self._active = stage

    def stage_owner(self, stage: int) -> int:
        """Pipeline rank (index into :attr:`stage_ranks`) that holds ``stage``."""
        return stage % self.num_stages

    def _build(self, layer: Any, cells: list[nn.Cell]) -> _Position:
        if isinstance(layer, TiedLayerSpec):
            cell = self.tied_modules.get(layer.key)
            if cell is None:
                cell = self.tied_modules[layer.key] = layer.build()
                cells.append(cell)
            fwd = layer.forward_fn
            return _Position((lambda x, c=cell, f=fwd: f(c, x)) if fwd is not None else cell, cell)
        if isinstance(layer, LayerSpec):
            cell = layer.build()
            cells.append(cell)
            return _Position(cell, cell)
        if isinstance(layer, nn.Cell):
            cells.append(layer)
            return _Position(layer, layer)
        return _Position(layer, None)

    def tied_parameters(self, key: str) -> list[Any]:
        """This stage's copies of the parameters tied under ``key``."""
        return [get_dotted(self.tied_modules[key], attr) for attr in self._tied_attrs[key]]

    def tied_group(self, key: str) -> Any:
        """The platform group of the stages owning ``key`` (every rank calls it alike)."""
        return get_platform().new_group([self.stage_ranks[r] for r in self.tied_owners[key]])

    def _tie(self) -> None:
        """Start every tied weight from its first owning stage's values."""
        platform = get_platform()
        for key, owners in self.tied_owners.items():
            if len(owners) < 2:
                continue
            group = self.tied_group(key)   # all ranks call new_group; members create it
            if self.stage_id not in owners:
                continue
            for param in self.tied_parameters(key):
                buf = copy_tensor(param.value())
                platform.broadcast(buf, src=self.stage_ranks[owners[0]], group=group)
                param.set_data(buf)

    def construct(self, x: Any) -> Any:
        for pos in self._positions:
            x = pos.fn(x)
        return x

    def __repr__(self) -> str:   # Cell's repr lists children; say where the stages sit
        layers = ", ".join(f"{self.parts[s]}:{self.parts[s + 1]}" for s in self.local_stages)
        return (f"PipelineModule(stages {self.local_stages} of {self.total_stages} on pipeline "
                f"rank {self.stage_id} of {self.num_stages}, dp {self.dp_size}, layers "
                f"{layers}, tied {sorted(self.tied_owners)})")
