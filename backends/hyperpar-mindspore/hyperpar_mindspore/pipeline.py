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

from hyperpar.pipeline.partition import partition_layers
from hyperpar.pipeline.spec import LayerSpec, TiedLayerSpec, get_dotted
from hyperpar.platform import get_platform

__all__ = ["PipelineModule"]


class _Position:
    """One entry of the stage: a Cell, a tied Cell through ``forward_fn``, or a callable."""

    def __init__(self, fn: Callable[[Any], Any], cell: nn.Cell | None) -> None:
        self.fn, self.cell = fn, cell


class PipelineModule(nn.Cell):
    """``PipelineModule(layers, num_stages=None, *, loss_fn=None, partition_method=
    "parameters")``: the layers of this rank's stage, built from ``layers`` (``LayerSpec``,
    ``TiedLayerSpec``, Cells or plain callables), as torch's ``PipelineModule`` does.

    One stage per rank over the whole world (``num_stages`` defaults to the world size; data
    parallelism across pipelines is not supported on MindSpore yet). ``partition_method`` is
    ``"uniform"``, ``"parameters"``, ``"type:REGEX"`` or a list of boundaries. Tied weights
    (same ``TiedLayerSpec`` key on several stages) start from the first owning stage's values;
    the engine sums their gradients over the owning stages. ``construct(x)`` runs the stage.
    """

    def __init__(self, layers: Sequence[Any], num_stages: int | None = None, *,
                 loss_fn: Callable[..., Any] | None = None,
                 partition_method: str | Sequence[int] = "parameters") -> None:
        super().__init__()
        platform = get_platform()
        if not platform.is_initialized():
            platform.init_process_group()
        world, rank = platform.world_size(), platform.rank()
        layers = list(layers)
        if num_stages is None:
            num_stages = world
        if num_stages != world:
            raise ValueError(
                f"PipelineModule: num_stages={num_stages} but the world has {world} ranks; on "
                f"MindSpore a pipeline has one stage per rank over the whole world (data "
                f"parallelism across pipelines is not supported yet): use num_stages={world}")
        for i, layer in enumerate(layers):
            if not (isinstance(layer, LayerSpec | nn.Cell) or callable(layer)):
                raise TypeError(f"PipelineModule: layer {i} is a {type(layer).__name__}; give "
                                f"LayerSpec/TiedLayerSpec, Cells or callables")
        self.parts = partition_layers(layers, num_stages, partition_method)
        self.num_stages = self.total_stages = num_stages
        self.virtual_stages = 1
        self.stage_id = rank
        self.local_stages = [rank]
        self.stage_ranks = list(range(world))
        self.group = None
        self.loss_fn = loss_fn
        # tied keys: which stages hold a position with the key (every rank computes it alike)
        self.tied_owners: dict[str, list[int]] = {}
        self._tied_attrs: dict[str, list[str]] = {}
        for s in range(num_stages):
            for layer in layers[self.parts[s]:self.parts[s + 1]]:
                if isinstance(layer, TiedLayerSpec):
                    owners = self.tied_owners.setdefault(layer.key, [])
                    if s not in owners:
                        owners.append(s)
                    self._tied_attrs[layer.key] = layer.tied_weight_attr
        cells: list[nn.Cell] = []
        self.tied_modules: dict[str, nn.Cell] = {}
        self._positions: list[_Position] = []
        for layer in layers[self.parts[rank]:self.parts[rank + 1]]:
            self._positions.append(self._build(layer, cells))
        self.stage_layers = nn.CellList(cells)
        self._tie()

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
        return get_platform().new_group([self.stage_ranks[s] for s in self.tied_owners[key]])

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
                buf = param.value().copy()
                platform.broadcast(buf, src=self.stage_ranks[owners[0]], group=group)
                param.set_data(buf)

    def construct(self, x: Any) -> Any:
        for pos in self._positions:
            x = pos.fn(x)
        return x

    def __repr__(self) -> str:   # Cell's repr lists children; say where the stage sits
        return (f"PipelineModule(stage {self.stage_id} of {self.num_stages}, layers "
                f"{self.parts[self.stage_id]}:{self.parts[self.stage_id + 1]}, tied "
                f"{sorted(self.tied_owners)})")
