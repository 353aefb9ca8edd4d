"""What the explicit tensor-parallel layers (Megatron's ``ColumnParallelLinear``,
``RowParallelLinear``, ``VocabParallelEmbedding``; EasyDeL's ``ParallelLinear`` family) mean,
written once for every framework (this module imports none): which style each call form applies,
the checks of their keywords, and the tensor-parallel mesh they use. Each framework's layer *is*
its Linear / Dense / Embedding with that style applied at construction
(:mod:`hyperpar.torch.parallel.layers`, ``hyperpar_mindspore.layers``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hyperpar.dtensor.mesh import DeviceMesh, current_mesh, init_device_mesh
from hyperpar.dtensor.placement import Replicate, Shard
from hyperpar.platform import get_platform

from .styles import ColwiseParallel, ParallelStyle, RowwiseParallel

if TYPE_CHECKING:
    from .easydel import TensorParallelConfig

__all__ = ["EASYDEL_KEYS", "column_style", "easydel_form", "easydel_style", "no_megatron",
           "row_style", "tp_mesh", "vocab_style"]


def tp_mesh(device_mesh: DeviceMesh | None) -> DeviceMesh:
    """The tensor-parallel 1-D mesh: ``device_mesh`` (or the current mesh, else the whole world)
    resolved like ``parallelize_module`` does: a 1-D mesh whole, an n-D mesh's ``"tp"`` dim."""
    mesh = device_mesh if device_mesh is not None else current_mesh()
    if mesh is None:
        return init_device_mesh((get_platform().world_size(),), mesh_dim_names=("tp",))
    return mesh.get_mesh(default="tp")


def _with_source(style: ParallelStyle, src_data_rank: int | None) -> ParallelStyle:
    style.src_data_rank = src_data_rank  # the rank whose initial parameters every rank takes
    return style


def column_style(*, gather_output: bool, sequence_parallel: bool, sequence_dim: int,
                 src_data_rank: int | None,
                 reshard_input_after_forward: bool | None = None) -> ParallelStyle:
    """Megatron's ``ColumnParallelLinear``: a replicated (or, with ``sequence_parallel``,
    sequence-sharded) input; the output's features stay split unless ``gather_output``;
    ``reshard_input_after_forward`` as ``ColwiseParallel``'s (``None``: the default, which
    saves the sequence shard as Megatron does)."""
    return _with_source(ColwiseParallel(
        input_layouts=Shard(sequence_dim) if sequence_parallel else Replicate(),
        output_layouts=Replicate() if gather_output else Shard(-1),
        reshard_input_after_forward=reshard_input_after_forward), src_data_rank)


def row_style(*, input_is_parallel: bool, sequence_parallel: bool, sequence_dim: int,
              src_data_rank: int | None) -> ParallelStyle:
    """Megatron's ``RowParallelLinear``: the input's features split (or whole, split here when
    not ``input_is_parallel``); the partial sums all-reduced, or reduce-scattered along
    ``sequence_dim`` with ``sequence_parallel``."""
    return _with_source(RowwiseParallel(
        input_layouts=Shard(-1) if input_is_parallel else Replicate(),
        output_layouts=Shard(sequence_dim) if sequence_parallel else Replicate()),
        src_data_rank)


def vocab_style(*, sequence_parallel: bool, sequence_dim: int,
                src_data_rank: int | None, **embedding_kwargs: Any) -> ParallelStyle:
    """``VocabParallelEmbedding``: rows split by vocabulary, replicated ids, the partial
    lookups all-reduced (or reduce-scattered along ``sequence_dim``). ``embedding_kwargs``:
    what the layer passes on to its framework's embedding, checked here -- ``padding_idx`` and
    ``max_norm`` act on whole rows a rank may not hold, so they are refused."""
    refused = [k for k in ("padding_idx", "max_norm") if embedding_kwargs.get(k) is not None]
    if refused:
        raise NotImplementedError(f"VocabParallelEmbedding: {' and '.join(refused)} not "
                                  f"supported; mask the padding positions' outputs (or clip "
                                  f"the looked-up rows) after it instead")
    return _with_source(RowwiseParallel(
        input_layouts=Replicate(),
        output_layouts=Shard(sequence_dim) if sequence_parallel else Replicate()),
        src_data_rank)


#: the keywords that select EasyDeL's call form of a parallel linear
EASYDEL_KEYS = frozenset({"use_bias", "param_dtype", "kernel_init", "bias_init",
                          "parallel_config", "precision"})


def easydel_form(kwargs: dict[str, Any]) -> bool:
    """Whether ``kwargs`` (what a layer took beyond Megatron's keywords) select EasyDeL's
    form; raises on a keyword neither form takes."""
    unknown = sorted(set(kwargs) - EASYDEL_KEYS)
    if unknown:
        raise TypeError(f"unexpected keyword arguments {unknown}; the EasyDeL form takes "
                        f"{sorted(EASYDEL_KEYS)}")
    return bool(kwargs)


def no_megatron(layer: str, **given: Any) -> None:
    """The two call forms do not mix: a Megatron keyword next to EasyDeL ones is an error
    (``given``: each Megatron keyword's value; ``bias`` counts when not ``True``)."""
    mixed = [k for k, v in given.items() if (v is not True if k == "bias" else bool(v))]
    if mixed:
        raise TypeError(f"{layer}: {mixed} belong to the Megatron form; with EasyDeL keywords "
                        f"(use_bias=, parallel_config=, ...) configure the layer through "
                        f"TensorParallelConfig and use_bias= instead")


def easydel_style(direction: str | None, config: TensorParallelConfig) -> ParallelStyle:
    """EasyDeL's column / row layer under ``config``: outputs replicated unless
    ``config.reduce_scatter_output`` (``reduce_output=True`` wins over it, as upstream)."""
    scatter = config.reduce_scatter_output and not config.reduce_output
    if direction == "column":
        return ColwiseParallel(output_layouts=Shard(-1) if scatter else Replicate())
    return RowwiseParallel(input_layouts=Shard(-1),
                           output_layouts=Shard(-1) if scatter else Replicate())
