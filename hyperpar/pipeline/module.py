"""PipelineModule: a layer list split into stages, of which each rank builds only its own."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from hyperpar.platform import get_platform
from hyperpar.platform.base import Group

from .layout import check_layout_arguments, resolve_stages
from .partition import partition_layers
from .spec import LayerSpec, TiedLayerSpec, get_dotted

if TYPE_CHECKING:
    from hyperpar.dtensor.mesh import DeviceMesh


class PipelineModule(nn.Module):
    """A sequence of layers split into ``num_stages`` pipeline stages over a process group.

    The positional arguments are DeepSpeed's, in DeepSpeed's order (``layers, num_stages,
    topology, loss_fn, seed_layers, seed_fn, base_seed, partition_method,
    activation_checkpoint_interval, activation_checkpoint_func, checkpointable_layers,
    dynamic_shape``), with DeepSpeed's meaning.

    ``layers`` may hold :class:`LayerSpec` / :class:`TiedLayerSpec` (built only on the rank that
    owns them), plain modules, or callables (e.g. ``lambda x: x.flatten(1)``). Layer ``i`` is
    called as ``layer(x)`` with whatever layer ``i - 1`` returned (a tensor or a tuple).

    The pipeline group is ``group`` (a platform group handle; default: the world, joined from
    the launcher's environment when no process group exists yet, as ``init_device_mesh``
    does), dimension
    ``mesh_dim`` of the :class:`~hyperpar.dtensor.DeviceMesh` ``mesh`` (default: the one named
    ``"pp"``; a 1-D mesh is used whole), resolved by ``mesh.get_mesh(mesh_dim, default="pp")``,
    or the ``"pipe"`` axis of a DeepSpeed-style ``topology`` (see
    :mod:`hyperpar.pipeline.topology`; it becomes a mesh with the same rank layout).
    ``num_stages`` defaults to the group size; a smaller divisor of the world size splits the
    world into ``world // num_stages`` independent pipelines of consecutive stages
    (pipeline ``d`` is global ranks ``d, d + dp, d + 2*dp, ...``), as DeepSpeed does. The
    replicas of this rank's stage form :attr:`dp_group` (:attr:`dp_size` ranks), which
    :class:`~hyperpar.pipeline.PipelineEngine` averages gradients and losses over.

    ``virtual_stages=v`` cuts the layers into ``num_stages * v`` stages placed round-robin
    (stage ``s`` on pipeline rank ``s % num_stages``), for interleaved schedules.

    ``partition_method``: ``"parameters"`` (default), ``"uniform"``, ``"type:REGEX"`` or an
    explicit list of boundaries (see :func:`~hyperpar.pipeline.partition_layers`).

    ``activation_checkpoint_interval=k`` recomputes each run of ``k`` layers in backward
    instead of storing its activations (0: off), with ``activation_checkpoint_func(fn, *inputs)``
    (default: non-reentrant ``torch.utils.checkpoint``). As in DeepSpeed, a run is checkpointed
    only if every layer's class name is in ``checkpointable_layers`` or, when that is ``None``,
    if it holds parameters. ``seed_layers=True`` calls ``seed_fn(base_seed + i)`` (default: the
    platform's ``manual_seed``) before building layer ``i``, so a layer's initial weights do
    not depend on the partition (a tied layer uses the index of its first position).
    ``dynamic_shape=True`` makes schedules resend activation shapes every step.
    """

    def __init__(self, layers: Sequence[Any], num_stages: int | None = None,
                 topology: Any = None, loss_fn: Callable[..., torch.Tensor] | None = None,
                 seed_layers: bool = False, seed_fn: Callable[[int], Any] | None = None,
                 base_seed: int = 1234, partition_method: str | Sequence[int] = "parameters",
                 activation_checkpoint_interval: int = 0,
                 activation_checkpoint_func: Callable[..., Any] | None = None,
                 checkpointable_layers: Sequence[str] | None = None,
                 dynamic_shape: bool = False, *, group: Group = None,
                 mesh: DeviceMesh | None = None, mesh_dim: str | int | None = None,
                 virtual_stages: int = 1) -> None:
        super().__init__()
        layers = list(layers.children()) if isinstance(layers, nn.Sequential) else list(layers)
        _check_arguments(layers, num_stages, topology, group, mesh, virtual_stages,
                         activation_checkpoint_interval, checkpointable_layers)
        self.loss_fn = loss_fn
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.activation_checkpoint_func = activation_checkpoint_func
        self.checkpointable_layers = (list(checkpointable_layers)
                                      if checkpointable_layers is not None else None)
        self.dynamic_shape = dynamic_shape
        self.seed_layers, self.seed_fn, self.base_seed = seed_layers, seed_fn, base_seed
        self._setup_stages(num_stages, group, mesh, mesh_dim, topology, virtual_stages)
        self.parts = partition_layers(layers, self.total_stages, partition_method)
        self._n_layers = len(layers)
        self._build_local_layers(layers)
        self._setup_tied(layers, get_platform(), get_platform().is_initialized())

    # ------------------------------------------------------------------ construction steps
    def _setup_stages(self, num_stages: int | None, group: Group, mesh: DeviceMesh | None,
                      mesh_dim: str | int | None, topology: Any, virtual_stages: int) -> None:
        """Pipeline group, stage ranks, this rank's stages and the data-parallel group
        (:func:`hyperpar.pipeline.layout.resolve_stages`, shared with MindSpore)."""
        layout = resolve_stages(num_stages, group=group, mesh=mesh, mesh_dim=mesh_dim,
                                topology=topology, virtual_stages=virtual_stages)
        layout.apply_to(self)

    def _seed(self, index: int) -> None:
        if self.seed_fn is not None:
            self.seed_fn(self.base_seed + index)
        else:
            get_platform().manual_seed(self.base_seed + index)

    def _build_local_layers(self, layers: list[Any]) -> None:
        """Build the layers of this rank's stages; tied modules once per key."""
        self.tied_modules = nn.ModuleDict()
        self._tied_attrs: dict[str, list[str]] = {}
        self._tied_groups: dict[str, Any] = {}
        self._tied_src: dict[str, int] = {}
        first_index: dict[str, int] = {}
        for i, layer in enumerate(layers):
            if isinstance(layer, TiedLayerSpec):
                first_index.setdefault(layer.key, i)
        self._funcs: dict[int, Callable[..., Any]] = {}
        self._layer_modules: dict[int, list[nn.Module]] = {}
        device = get_platform().device()
        for stage in self.local_stages:
            for i in self.stage_layers(stage):
                layer = layers[i]
                if isinstance(layer, TiedLayerSpec):
                    if layer.key not in self.tied_modules:
                        if self.seed_layers:
                            self._seed(first_index[layer.key])
                        self.tied_modules[layer.key] = layer.build().to(device)
                        self._tied_attrs[layer.key] = list(layer.tied_weight_attr)
                    module = self.tied_modules[layer.key]
                    self._funcs[i] = (partial(layer.forward_fn, module)
                                      if layer.forward_fn is not None else module)
                    self._layer_modules[i] = [module]
                    continue
                if isinstance(layer, LayerSpec):
                    if self.seed_layers:
                        self._seed(i)
                    layer = layer.build()
                if isinstance(layer, nn.Module):
                    self.add_module(str(i), layer.to(device))
                    self._layer_modules[i] = [layer]
                else:
                    self._layer_modules[i] = []
                self._funcs[i] = layer
        for key, attrs in self._tied_attrs.items():   # fail now, not at the first backward
            for attr in attrs:
                get_dotted(self.tied_modules[key], attr)

    # ------------------------------------------------------------------ tied weights
    def stage_owner(self, stage: int) -> int:
        """Pipeline rank (index into :attr:`stage_ranks`) that holds ``stage``."""
        return stage % self.num_stages

    def _setup_tied(self, layers: list[Any], platform: Any, distributed: bool) -> None:
        owners: dict[str, list[int]] = {}
        for stage in range(self.total_stages):
            for i in range(self.parts[stage], self.parts[stage + 1]):
                if isinstance(layers[i], TiedLayerSpec):
                    lst = owners.setdefault(layers[i].key, [])
                    owner = self.stage_owner(stage)
                    if owner not in lst:
                        lst.append(owner)
        self.tied_owners = owners  # key -> pipeline ranks holding a copy, first owner first
        shared = sorted(k for k, o in owners.items() if len(o) > 1)
        if not distributed or self.num_stages == 1 or not shared:
            return
        # new_group is collective over the world: every rank creates the tied groups of every
        # pipeline (other data-parallel replicas, other mesh rows) in the same order.
        pipelines = sorted({tuple(r) for r in platform.all_gather_object(self.stage_ranks)})
        for key in shared:
            for pipeline in map(list, pipelines):
                ranks = sorted(pipeline[o] for o in owners[key])
                handle = platform.new_group(ranks)
                if self.stage_ranks == pipeline and key in self.tied_modules:
                    self._tied_groups[key] = handle
                    self._tied_src[key] = pipeline[owners[key][0]]
        self.synchronize_tied_weights()

    def synchronize_tied_weights(self) -> None:
        """Broadcast every tied weight from its first owning stage to the other owners."""
        platform = get_platform()
        for key, handle in self._tied_groups.items():
            for attr in self._tied_attrs[key]:
                param = get_dotted(self.tied_modules[key], attr)
                with torch.no_grad():
                    platform.broadcast(param.data, src=self._tied_src[key], group=handle)

    def tied_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """``(key.attr, parameter)`` for the tied weights held by this rank."""
        return [(f"{key}.{attr}", get_dotted(self.tied_modules[key], attr))
                for key in self.tied_modules for attr in self._tied_attrs[key]]

    def allreduce_tied_gradients(self) -> None:
        """Sum tied-weight gradients among the owning stages, so every copy gets the same,
        complete gradient (a missing gradient counts as zero)."""
        platform = get_platform()
        for key, handle in self._tied_groups.items():
            for attr in self._tied_attrs[key]:
                param = get_dotted(self.tied_modules[key], attr)
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                platform.all_reduce(param.grad, "sum", group=handle)

    def _stash_tied_gradients(self) -> list[tuple[nn.Parameter, torch.Tensor | None]]:
        """Set aside gradients accumulated before a step, so only the step's own contribution
        is all-reduced; :meth:`_restore_tied_gradients` adds them back."""
        stash = []
        for key in self._tied_groups:
            for attr in self._tied_attrs[key]:
                param = get_dotted(self.tied_modules[key], attr)
                stash.append((param, param.grad))
                param.grad = None
        return stash

    @staticmethod
    def _restore_tied_gradients(stash: list[tuple[nn.Parameter, torch.Tensor | None]]) -> None:
        for param, grad in stash:
            if grad is not None:
                param.grad = grad if param.grad is None else param.grad.add_(grad)

    # ------------------------------------------------------------------ forward
    def stage_layers(self, stage: int) -> range:
        """Global indices of the layers of ``stage``."""
        return range(self.parts[stage], self.parts[stage + 1])

    def stage_units(self, stage: int) -> list[list[int]]:
        """The stage's layers grouped into checkpoint units (one layer each when off)."""
        idx = list(self.stage_layers(stage))
        k = self.activation_checkpoint_interval or 1
        return [idx[j:j + k] for j in range(0, len(idx), k)]

    def unit_parameters(self, unit: Sequence[int]) -> list[nn.Parameter]:
        """Trainable parameters used by the layers of ``unit`` (deduplicated)."""
        seen: dict[int, nn.Parameter] = {}
        for i in unit:
            for module in self._layer_modules[i]:
                for p in module.parameters():
                    if p.requires_grad:
                        seen.setdefault(id(p), p)
        return list(seen.values())

    def is_checkpointable(self, unit: Sequence[int]) -> bool:
        """DeepSpeed's rule: every layer's class name in ``checkpointable_layers``, or (when
        that is ``None``) some layer is a module with parameters."""
        funcs = [self._funcs[i] for i in unit]
        if self.checkpointable_layers is not None:
            return all(type(f).__name__ in self.checkpointable_layers for f in funcs)
        return any(isinstance(f, nn.Module) and next(f.parameters(), None) is not None
                   for f in funcs)

    def run_unit(self, unit: Sequence[int], x: Any, **kwargs: Any) -> Any:
        """Run the layers of ``unit`` on ``x`` (checkpointed when the interval is set and the
        unit is checkpointable)."""
        def run(inp: Any, **kw: Any) -> Any:
            for j, i in enumerate(unit):
                inp = self._funcs[i](inp, **kw) if (kw and j == 0) else self._funcs[i](inp)
            return inp

        if not (self.activation_checkpoint_interval and torch.is_grad_enabled()
                and self.is_checkpointable(unit)):
            return run(x, **kwargs)
        if self.activation_checkpoint_func is None:
            return checkpoint(run, x, use_reentrant=False, **kwargs)

        def run_unpacked(*inputs: Any) -> Any:   # DeepSpeed's calling convention
            return run(inputs[0] if len(inputs) == 1 else inputs, **kwargs)

        return self.activation_checkpoint_func(run_unpacked,
                                               *(x if isinstance(x, tuple) else (x,)))

    def forward_stage(self, stage: int, x: Any, **kwargs: Any) -> Any:
        """Run every layer of ``stage`` (which must be local) on ``x``."""
        if stage not in self.local_stages:
            raise ValueError(f"stage {stage} is not on this rank (local stages: "
                             f"{self.local_stages})")
        for j, unit in enumerate(self.stage_units(stage)):
            x = self.run_unit(unit, x, **(kwargs if j == 0 else {}))
        return x

    def forward(self, x: Any, **kwargs: Any) -> Any:
        """Run the whole model; only possible when this rank holds every stage (one stage)."""
        if len(self.local_stages) != self.total_stages:
            raise RuntimeError(
                f"PipelineModule.forward runs the whole model, but this rank holds only stages "
                f"{self.local_stages} of {self.total_stages}; drive a pipeline with a schedule, "
                f"e.g. Schedule1F1B(module, n_microbatches).step(x, target=y)"
            )
        for stage in range(self.total_stages):
            x = self.forward_stage(stage, x, **(kwargs if stage == 0 else {}))
        return x

    def num_pipeline_stages(self) -> int:
        """The number of pipeline stages (DeepSpeed's name)."""
        return self.num_stages

    def partitions(self) -> list[int]:
        """The stage boundaries (DeepSpeed's name for :attr:`parts`)."""
        return list(self.parts)

    def extra_repr(self) -> str:
        return (f"stages={self.total_stages} (pipeline rank {self.stage_id} of "
                f"{self.num_stages}, local stages {self.local_stages}), parts={self.parts}")


def _check_arguments(layers: list[Any], num_stages: int | None, topology: Any, group: Group,
                     mesh: Any, virtual_stages: int, interval: int,
                     checkpointable_layers: Sequence[str] | None) -> None:
    """Everything checkable before any collective, raised the same way on every rank."""
    if not layers:
        raise ValueError("PipelineModule: the layer list is empty")
    check_layout_arguments(num_stages, topology, group, mesh, virtual_stages)
    if interval < 0:
        raise ValueError(f"PipelineModule: activation_checkpoint_interval must be >= 0, got "
                         f"{interval}")
    if checkpointable_layers is not None and (
            isinstance(checkpointable_layers, str)
            or not all(isinstance(n, str) for n in checkpointable_layers)):
        raise TypeError(f"PipelineModule: checkpointable_layers must be a list of class names, "
                        f"e.g. ['TransformerLayer'], got {checkpointable_layers!r}")
    for i, layer in enumerate(layers):
        if isinstance(layer, PipelineModule):
            raise NotImplementedError(f"PipelineModule: layer {i} is itself a PipelineModule; "
                                      f"nesting is not supported (flatten its layer list)")
        if not (isinstance(layer, LayerSpec | nn.Module) or callable(layer)):
            raise TypeError(
                f"PipelineModule: layer {i} is {layer!r} of type {type(layer).__name__}; "
                f"expected a LayerSpec, TiedLayerSpec, nn.Module or callable"
            )
