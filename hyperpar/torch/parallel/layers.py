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

from hyperpar.dtensor.mesh import DeviceMesh
from hyperpar.dtensor.placement import Replicate
from hyperpar.parallel.layer_plan import (
    column_style,
    easydel_form,
    easydel_style,
    no_megatron,
    row_style,
    tp_mesh,
    vocab_style,
)
from hyperpar.platform import get_platform

if TYPE_CHECKING:
    from hyperpar.parallel.easydel import TensorParallelConfig

__all__ = ["ColumnParallelLinear", "ParallelLinear", "RowParallelLinear",
           "VocabParallelEmbedding"]


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
        style = easydel_style(self._direction, config)
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
      device=None, dtype=None, reshard_input_after_forward=None)``. The output is this rank's
      slice of the features (last dim) unless ``gather_output``; with ``sequence_parallel``
      the gathered input is saved as its shard and gathered again in backward, as Megatron
      does, unless ``reshard_input_after_forward=False`` (see ``ColwiseParallel``).
      Parameters are initialised like ``nn.Linear`` on every rank and
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
                 reshard_input_after_forward: bool | None = None, **easydel: Any) -> None:
        if easydel_form(easydel):
            no_megatron(type(self).__name__, gather_output=gather_output,
                        sequence_parallel=sequence_parallel, device_mesh=device_mesh, bias=bias,
                        reshard_input_after_forward=reshard_input_after_forward is not None)
            super().__init__(in_features, out_features, dtype=dtype, device=device, **easydel)
            return
        nn.Linear.__init__(self, in_features, out_features, bias, device=device, dtype=dtype)
        self.use_bias, self.compute_dtype, self.param_dtype = bias, None, self.weight.dtype
        self.parallel_config = None
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        style = column_style(gather_output=gather_output, sequence_parallel=sequence_parallel,
                             sequence_dim=sequence_dim, src_data_rank=src_data_rank,
                             reshard_input_after_forward=reshard_input_after_forward)
        style._apply(self, tp_mesh(device_mesh))


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
        if easydel_form(easydel):
            no_megatron(type(self).__name__, input_is_parallel=not input_is_parallel,
                        sequence_parallel=sequence_parallel, device_mesh=device_mesh, bias=bias)
            super().__init__(in_features, out_features, dtype=dtype, device=device, **easydel)
            return
        nn.Linear.__init__(self, in_features, out_features, bias, device=device, dtype=dtype)
        self.use_bias, self.compute_dtype, self.param_dtype = bias, None, self.weight.dtype
        self.parallel_config = None
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        style = row_style(input_is_parallel=input_is_parallel,
                          sequence_parallel=sequence_parallel, sequence_dim=sequence_dim,
                          src_data_rank=src_data_rank)
        style._apply(self, tp_mesh(device_mesh))


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
        style = vocab_style(sequence_parallel=sequence_parallel, sequence_dim=sequence_dim,
                            src_data_rank=src_data_rank, **kwargs)  # checks kwargs
        super().__init__(num_embeddings, embedding_dim, **kwargs)
        self.sequence_parallel = sequence_parallel
        style._apply(self, tp_mesh(device_mesh))
