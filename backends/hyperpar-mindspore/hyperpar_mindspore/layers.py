"""Megatron's explicit tensor-parallel layers as Cells: ``ColumnParallelLinear`` and
``RowParallelLinear`` are an ``nn.Dense``, ``VocabParallelEmbedding`` an ``nn.Embedding``, with
the matching style applied at construction -- the styles and keywords of PyTorch's layers
(:mod:`hyperpar.parallel.layer_plan`, written once), MindSpore's Cells and mechanics.

The Megatron call form only: EasyDeL's (``kernel_init=``, ``parallel_config=``) takes torch
initialisers and has no Cell here. Parameters are initialised by MindSpore's defaults on every
rank and scattered from ``src_data_rank`` (seed identically, or keep 0).
"""

from __future__ import annotations

from typing import Any

from mindspore import nn

from hyperpar.dtensor.mesh import DeviceMesh
from hyperpar.parallel.layer_plan import column_style, row_style, tp_mesh, vocab_style

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding"]


class ColumnParallelLinear(nn.Dense):
    """``y = x W^T + b`` with ``W`` (and ``b``) split by output features over the mesh.

    ``ColumnParallelLinear(in_features, out_features, bias=True, *, gather_output=False,
    sequence_parallel=False, sequence_dim=1, device_mesh=None, src_data_rank=0,
    **dense_kwargs)`` (``weight_init``, ``bias_init``, ``dtype`` go to ``nn.Dense``). The output
    is this rank's slice of the features (last dim) unless ``gather_output``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 gather_output: bool = False, sequence_parallel: bool = False,
                 sequence_dim: int = 1, device_mesh: DeviceMesh | None = None,
                 src_data_rank: int | None = 0, **dense_kwargs: Any) -> None:
        super().__init__(in_features, out_features, has_bias=bias, **dense_kwargs)
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        column_style(gather_output=gather_output, sequence_parallel=sequence_parallel,
                     sequence_dim=sequence_dim, src_data_rank=src_data_rank
                     )._apply(self, tp_mesh(device_mesh))


class RowParallelLinear(nn.Dense):
    """``y = x W^T + b`` with ``W`` split by input features over the mesh: the partial sums
    are all-reduced (or reduce-scattered along ``sequence_dim`` with ``sequence_parallel``) and
    the whole bias is added once.

    ``RowParallelLinear(in_features, out_features, bias=True, *, input_is_parallel=True,
    sequence_parallel=False, sequence_dim=1, device_mesh=None, src_data_rank=0,
    **dense_kwargs)``; ``input_is_parallel=False`` takes the whole features and uses this
    rank's slice."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 input_is_parallel: bool = True, sequence_parallel: bool = False,
                 sequence_dim: int = 1, device_mesh: DeviceMesh | None = None,
                 src_data_rank: int | None = 0, **dense_kwargs: Any) -> None:
        super().__init__(in_features, out_features, has_bias=bias, **dense_kwargs)
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        row_style(input_is_parallel=input_is_parallel, sequence_parallel=sequence_parallel,
                  sequence_dim=sequence_dim, src_data_rank=src_data_rank
                  )._apply(self, tp_mesh(device_mesh))


class VocabParallelEmbedding(nn.Embedding):
    """An embedding whose rows (the vocabulary) are split over the mesh: ids held elsewhere
    look up zeros and the partial lookups are all-reduced (or reduce-scattered along
    ``sequence_dim`` with ``sequence_parallel``).

    ``VocabParallelEmbedding(num_embeddings, embedding_dim, *, sequence_parallel=False,
    sequence_dim=1, device_mesh=None, src_data_rank=0, **embedding_kwargs)``
    (``embedding_table_init``, ``dtype`` go to ``nn.Embedding``; ``padding_idx`` is refused, as
    on PyTorch)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *,
                 sequence_parallel: bool = False, sequence_dim: int = 1,
                 device_mesh: DeviceMesh | None = None, src_data_rank: int | None = 0,
                 **embedding_kwargs: Any) -> None:
        style = vocab_style(sequence_parallel=sequence_parallel, sequence_dim=sequence_dim,
                            src_data_rank=src_data_rank, **embedding_kwargs)  # checks them
        super().__init__(num_embeddings, embedding_dim, **embedding_kwargs)
        self.sequence_parallel = sequence_parallel
        style._apply(self, tp_mesh(device_mesh))
