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
* :class:`VocabParallelEmbedding` = ``RowwiseParallel`` on an Embedding (rows split by
  vocabulary, out-of-range ids masked, partial outputs all-reduced or reduce-scattered).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from hyperpar.dtensor.mesh import DeviceMesh, current_mesh, init_device_mesh
from hyperpar.dtensor.placement import Replicate, Shard
from hyperpar.platform import get_platform

from .style import ColwiseParallel, RowwiseParallel

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding"]


def _mesh(device_mesh: DeviceMesh | None) -> DeviceMesh:
    """The tensor-parallel 1-D mesh: ``device_mesh`` (or the current mesh, else the whole world)
    resolved like ``parallelize_module`` does: a 1-D mesh whole, an n-D mesh's ``"tp"`` dim."""
    mesh = device_mesh if device_mesh is not None else current_mesh()
    if mesh is None:
        return init_device_mesh((get_platform().world_size(),), mesh_dim_names=("tp",))
    return mesh.get_mesh(default="tp")


class ColumnParallelLinear(nn.Linear):
    """``y = x W^T + b`` with ``W`` split by output features over the mesh.

    The output is this rank's slice of the features (last dim) unless ``gather_output``.
    Parameters are initialised like ``nn.Linear`` on every rank and scattered from
    ``src_data_rank`` (seed identically, or keep 0).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 gather_output: bool = False, sequence_parallel: bool = False,
                 sequence_dim: int = 1, device_mesh: DeviceMesh | None = None,
                 src_data_rank: int | None = 0, device: Any = None, dtype: Any = None) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        style = ColwiseParallel(
            input_layouts=Shard(sequence_dim) if sequence_parallel else Replicate(),
            output_layouts=Replicate() if gather_output else Shard(-1),
        )
        style.src_data_rank = src_data_rank
        style._apply(self, _mesh(device_mesh))


class RowParallelLinear(nn.Linear):
    """``y = x W^T + b`` with ``W`` split by input features over the mesh; partial products
    are all-reduced (or reduce-scattered along ``sequence_dim`` when ``sequence_parallel``)
    and the replicated bias is added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 input_is_parallel: bool = True, sequence_parallel: bool = False,
                 sequence_dim: int = 1, device_mesh: DeviceMesh | None = None,
                 src_data_rank: int | None = 0, device: Any = None, dtype: Any = None) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        style = RowwiseParallel(
            input_layouts=Shard(-1) if input_is_parallel else Replicate(),
            output_layouts=Shard(sequence_dim) if sequence_parallel else Replicate(),
        )
        style.src_data_rank = src_data_rank
        style._apply(self, _mesh(device_mesh))


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
