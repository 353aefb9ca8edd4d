"""Explicit tensor-parallel layers (Megatron / EasyDeL style) for code that prefers to build a
parallel model directly instead of applying a plan.

Each layer *is* a Linear / Embedding (so ``weight``/``bias`` have the usual full shapes as
DTensors) to which the matching style has been applied at construction: one implementation of
the math serves both the styles and the layers.

* :class:`ColumnParallelLinear` = ``ColwiseParallel``; ``gather_output=True`` all-gathers the
  output, ``sequence_parallel=True`` takes a sequence-sharded input (all-gather forward,
  reduce-scatter backward).
* :class:`RowParallelLinear` = ``RowwiseParallel``; ``input_is_parallel=False`` splits a
  replicated input, ``sequence_parallel=True`` reduce-scatters the output along the sequence.
* :class:`ParallelLinear` -- EasyDeL's base: a plain Linear, or with a
  :class:`~hyperpar.parallel.TensorParallelConfig` the column / row layers above built from it.
* :class:`VocabParallelEmbedding` = ``RowwiseParallel`` on an Embedding (rows split by
  vocabulary, out-of-range ids masked, partial outputs all-reduced or reduce-scattered).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.lazy import LazyModuleMixin
from torch.nn.parameter import UninitializedParameter

from hyperpar.dtensor.mesh import DeviceMesh, current_mesh, init_device_mesh
from hyperpar.dtensor.placement import Replicate, Shard
from hyperpar.platform import get_platform
from hyperpar.torch.parallel.style import ColwiseParallel, ParallelStyle, RowwiseParallel

if TYPE_CHECKING:
    from hyperpar.parallel.easydel import TensorParallelConfig

__all__ = ["ColumnParallelLinear", "ParallelLinear", "RowParallelLinear",
           "VocabParallelEmbedding"]


def _mesh(device_mesh: DeviceMesh | None) -> DeviceMesh:
    """The tensor-parallel 1-D mesh: ``device_mesh`` (or the current mesh, else the whole world)
    resolved like ``parallelize_module`` does: a 1-D mesh whole, an n-D mesh's ``"tp"`` dim."""
    mesh = device_mesh if device_mesh is not None else current_mesh()
    if mesh is None:
        return init_device_mesh((get_platform().world_size(),), mesh_dim_names=("tp",))
    return mesh.get_mesh(default="tp")


class ParallelLinear(nn.Linear):
    """EasyDeL's ``ParallelLinear``, in torch terms: ``y = x W^T + b``, optionally tensor-parallel.

    ``ParallelLinear(in_features, out_features, use_bias=True, dtype=None,
    param_dtype=torch.float32, kernel_init=None, bias_init=None, parallel_config=None)``:

    * ``dtype`` -- the computation dtype (``None``: promoted from input and weight);
      ``param_dtype`` -- the parameters' dtype;
    * ``kernel_init(weight)`` / ``bias_init(bias)`` -- in-place torch initialisers such as
      ``torch.nn.init.normal_`` applied to the full ``(out, in)`` weight before it is sharded
      (``None``: ``nn.Linear``'s own initialisation);
    * ``parallel_config`` -- a :class:`~hyperpar.parallel.TensorParallelConfig`. Without one (and
      always for the base class) the layer is a plain Linear. :class:`ColumnParallelLinear` and
      :class:`RowParallelLinear` shard it over the config's mesh axis.
    """

    _direction: str | None = None

    def __new__(cls, *args: Any, **kwargs: Any) -> ParallelLinear:
        # EasyDeL's older form ``ParallelLinear(features=768, ...)`` infers in_features from the
        # first input, like nn.LazyLinear
        if cls is ParallelLinear and "features" in kwargs and not args:
            return super().__new__(_LazyParallelLinear)
        return super().__new__(cls)

    def __init__(self, in_features: int, out_features: int, use_bias: bool = True,
                 dtype: torch.dtype | None = None, param_dtype: torch.dtype = torch.float32, *,
                 kernel_init: Callable[[torch.Tensor], Any] | None = None,
                 bias_init: Callable[[torch.Tensor], Any] | None = None,
                 parallel_config: TensorParallelConfig | None = None, device: Any = None,
                 precision: Any = None) -> None:
        if precision is not None:
            raise ValueError("ParallelLinear: precision= (a JAX dot precision) has no torch "
                             "equivalent here; leave it None")
        super().__init__(in_features, out_features, use_bias, device=device, dtype=param_dtype)
        self.use_bias = use_bias
        self.compute_dtype, self.param_dtype = dtype, param_dtype
        self.parallel_config = parallel_config
        with torch.no_grad():
            if kernel_init is not None:
                kernel_init(self.weight)
            if bias_init is not None and self.bias is not None:
                bias_init(self.bias)
        if parallel_config is not None and self._direction is not None:
            self._shard(parallel_config)

    def _shard(self, config: TensorParallelConfig) -> None:
        style = _easydel_style(self._direction, config, self.in_features)
        mesh = config.resolve_mesh()
        if self._direction == "row":   # a full-width (replicated) input is accepted too
            get_platform().register_forward_pre_hook(
                self, _full_input_as_replicated(mesh, self.in_features), prepend=True)
        style._apply(self, mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.compute_dtype is None and x.dtype == self.weight.dtype:
            return F.linear(x, self.weight, self.bias)
        dtype = self.compute_dtype or torch.promote_types(x.dtype, self.weight.dtype)
        bias = self.bias.to(dtype) if self.bias is not None else None
        return F.linear(x.to(dtype), self.weight.to(dtype), bias)


class _LazyParallelLinear(LazyModuleMixin, ParallelLinear):
    """``ParallelLinear(features=out, use_bias=True, dtype=None, param_dtype=torch.float32,
    kernel_init=None, bias_init=None, gather_output=..., axis_name=...)``: EasyDeL's module
    docstring form. A plain Linear (the base class is never sharded) whose ``in_features`` come
    from the first input; ``gather_output`` and ``axis_name`` are recorded, with no effect."""

    cls_to_become = ParallelLinear

    def __init__(self, *, features: int, use_bias: bool = True,
                 dtype: torch.dtype | None = None, param_dtype: torch.dtype = torch.float32,
                 kernel_init: Callable[[torch.Tensor], Any] | None = None,
                 bias_init: Callable[[torch.Tensor], Any] | None = None,
                 parallel_config: TensorParallelConfig | None = None,
                 gather_output: bool | None = None, axis_name: str | None = None,
                 device: Any = None) -> None:
        if parallel_config is not None:
            raise NotImplementedError("ParallelLinear(features=...) infers in_features lazily and "
                                      "is never sharded; give in_features and out_features to a "
                                      "Column/RowParallelLinear with a parallel_config instead")
        super().__init__(0, 0, False, dtype, param_dtype, device=device)
        self.out_features, self.use_bias = features, use_bias
        self.gather_output, self.axis_name = gather_output, axis_name
        self._inits = (kernel_init, bias_init)
        self.weight = UninitializedParameter(device=device, dtype=param_dtype)
        if use_bias:
            self.bias = UninitializedParameter(device=device, dtype=param_dtype)

    def reset_parameters(self) -> None:
        if not self.has_uninitialized_params() and self.in_features != 0:
            super().reset_parameters()

    def initialize_parameters(self, x: torch.Tensor) -> None:
        if not self.has_uninitialized_params():
            return
        with torch.no_grad():
            self.in_features = x.shape[-1]
            self.weight.materialize((self.out_features, self.in_features))
            if self.bias is not None:
                self.bias.materialize((self.out_features,))
            self.reset_parameters()
            kernel_init, bias_init = self._inits
            if kernel_init is not None:
                kernel_init(self.weight)
            if bias_init is not None and self.bias is not None:
                bias_init(self.bias)


class ColumnParallelLinear(ParallelLinear):
    """``y = x W^T + b`` with ``W`` split by output features over the mesh.

    Two call forms, one layer:

    * Megatron: ``ColumnParallelLinear(in, out, bias=True, *, gather_output=False,
      sequence_parallel=False, sequence_dim=1, device_mesh=None, src_data_rank=0,
      device=None, dtype=None)``. The output is this rank's slice of the features (last dim)
      unless ``gather_output``. Parameters are initialised like ``nn.Linear`` on every rank and
      scattered from ``src_data_rank`` (seed identically, or keep 0).
    * EasyDeL: ``ColumnParallelLinear(in, out, use_bias=True, dtype=None,
      param_dtype=torch.float32, kernel_init=..., bias_init=..., parallel_config=config)`` (see
      :class:`ParallelLinear`): the output is replicated (all-gathered) unless
      ``config.reduce_scatter_output``, which keeps this rank's slice of the features. Any of
      the EasyDeL keywords selects this form; without a ``parallel_config`` it is a plain
      Linear.
    """

    _direction = "column"

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 gather_output: bool = False, sequence_parallel: bool = False,
                 sequence_dim: int = 1, device_mesh: DeviceMesh | None = None,
                 src_data_rank: int | None = 0, device: Any = None, dtype: Any = None,
                 **easydel: Any) -> None:
        if _easydel_form(easydel):
            _no_megatron(self, gather_output=gather_output, sequence_parallel=sequence_parallel,
                         device_mesh=device_mesh, bias=bias)
            super().__init__(in_features, out_features, dtype=dtype, device=device, **easydel)
            return
        nn.Linear.__init__(self, in_features, out_features, bias, device=device, dtype=dtype)
        self.use_bias, self.compute_dtype, self.param_dtype = bias, None, self.weight.dtype
        self.parallel_config = None
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        style = ColwiseParallel(
            input_layouts=Shard(sequence_dim) if sequence_parallel else Replicate(),
            output_layouts=Replicate() if gather_output else Shard(-1),
        )
        style.src_data_rank = src_data_rank
        style._apply(self, _mesh(device_mesh))


class RowParallelLinear(ParallelLinear):
    """``y = x W^T + b`` with ``W`` split by input features over the mesh; partial products
    are all-reduced (or reduce-scattered) and the replicated bias is added once.

    * Megatron: ``RowParallelLinear(in, out, bias=True, *, input_is_parallel=True,
      sequence_parallel=False, sequence_dim=1, device_mesh=None, src_data_rank=0, device=None,
      dtype=None)``; ``sequence_parallel`` reduce-scatters along ``sequence_dim``.
    * EasyDeL: ``RowParallelLinear(in, out, use_bias=True, ..., parallel_config=config)``: the
      input may be this rank's slice of the features (what a column layer with
      ``reduce_scatter_output`` gives) or the full features (then each rank uses its slice);
      the output is all-reduced (replicated) unless ``config.reduce_scatter_output``, which
      reduce-scatters it along the last dim (``reduce_output=True`` wins over it, as upstream).
    """

    _direction = "row"

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 input_is_parallel: bool = True, sequence_parallel: bool = False,
                 sequence_dim: int = 1, device_mesh: DeviceMesh | None = None,
                 src_data_rank: int | None = 0, device: Any = None, dtype: Any = None,
                 **easydel: Any) -> None:
        if _easydel_form(easydel):
            _no_megatron(self, input_is_parallel=not input_is_parallel,
                         sequence_parallel=sequence_parallel, device_mesh=device_mesh,
                         bias=bias)
            super().__init__(in_features, out_features, dtype=dtype, device=device, **easydel)
            return
        nn.Linear.__init__(self, in_features, out_features, bias, device=device, dtype=dtype)
        self.use_bias, self.compute_dtype, self.param_dtype = bias, None, self.weight.dtype
        self.parallel_config = None
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        style = RowwiseParallel(
            input_layouts=Shard(-1) if input_is_parallel else Replicate(),
            output_layouts=Shard(sequence_dim) if sequence_parallel else Replicate(),
        )
        style.src_data_rank = src_data_rank
        style._apply(self, _mesh(device_mesh))


_EASYDEL_KEYS = {"use_bias", "param_dtype", "kernel_init", "bias_init", "parallel_config",
                 "precision"}


def _easydel_form(kwargs: dict[str, Any]) -> bool:
    unknown = sorted(set(kwargs) - _EASYDEL_KEYS)
    if unknown:
        raise TypeError(f"unexpected keyword arguments {unknown}; the EasyDeL form takes "
                        f"{sorted(_EASYDEL_KEYS)}")
    return bool(kwargs)


def _no_megatron(layer: nn.Module, **given: Any) -> None:
    """The two call forms do not mix: a Megatron keyword next to EasyDeL ones is an error."""
    mixed = [k for k, v in given.items() if (v is not True if k == "bias" else bool(v))]
    if mixed:
        raise TypeError(f"{type(layer).__name__}: {mixed} belong to the Megatron form; with "
                        f"EasyDeL keywords (use_bias=, parallel_config=, ...) configure the "
                        f"layer through TensorParallelConfig and use_bias= instead")


def _easydel_style(direction: str | None, config: TensorParallelConfig,
                   in_features: int) -> ParallelStyle:
    scatter = config.reduce_scatter_output and not config.reduce_output
    if direction == "column":
        return ColwiseParallel(output_layouts=Shard(-1) if scatter else Replicate())
    return RowwiseParallel(input_layouts=Shard(-1),
                           output_layouts=Shard(-1) if scatter else Replicate())


def _full_input_as_replicated(mesh: DeviceMesh, in_features: int) -> Callable[..., Any]:
    """A plain input holding all ``in_features`` is replicated: wrap it as such, so the style
    takes this rank's slice (and sums the input gradient over the ranks in backward)."""
    def hook(module: nn.Module, args: tuple) -> tuple | None:
        x = args[0]
        if isinstance(x, torch.Tensor) and not hasattr(x, "placements") \
                and mesh.size() > 1 and x.shape[-1] == in_features:
            from hyperpar.dtensor import DTensor

            return (DTensor.from_local(x, mesh, (Replicate(),), run_check=False), *args[1:])
        return None
    return hook


class VocabParallelEmbedding(nn.Embedding):
    """Embedding whose rows (the vocabulary) are split over the mesh."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *,
                 sequence_parallel: bool = False, sequence_dim: int = 1,
                 device_mesh: DeviceMesh | None = None, src_data_rank: int | None = 0,
                 **kwargs: Any) -> None:
        if kwargs.get("padding_idx") is not None or kwargs.get("max_norm") is not None:
            raise NotImplementedError("VocabParallelEmbedding: padding_idx/max_norm not supported")
        super().__init__(num_embeddings, embedding_dim, **kwargs)
        self.sequence_parallel = sequence_parallel
        style = RowwiseParallel(
            input_layouts=Replicate(),
            output_layouts=Shard(sequence_dim) if sequence_parallel else Replicate(),
        )
        style.src_data_rank = src_data_rank
        style._apply(self, _mesh(device_mesh))
