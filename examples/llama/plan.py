"""Tensor-parallel plans for ``model.Transformer`` -- the plan as data.

The plans are plain dicts ``{module path: style}`` with ``fnmatch`` wildcards. ``styles`` is the
namespace the style and placement classes come from: ``hyperpar`` (default) or
``torch.distributed.tensor.parallel`` + ``torch.distributed.tensor`` -- the same plan runs on both.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any


def hyperpar_styles() -> SimpleNamespace:
    from hyperpar.dtensor.placement import Replicate, Shard
    from hyperpar.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    return SimpleNamespace(ColwiseParallel=ColwiseParallel, RowwiseParallel=RowwiseParallel,
                           SequenceParallel=SequenceParallel,
                           PrepareModuleInput=PrepareModuleInput, Shard=Shard,
                           Replicate=Replicate)


def torch_styles() -> SimpleNamespace:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    return SimpleNamespace(ColwiseParallel=ColwiseParallel, RowwiseParallel=RowwiseParallel,
                           SequenceParallel=SequenceParallel,
                           PrepareModuleInput=PrepareModuleInput, Shard=Shard,
                           Replicate=Replicate)


def tp_plan(styles: SimpleNamespace | None = None) -> dict[str, Any]:
    """Megatron tensor parallelism: attention heads and FFN hidden units split over ranks,
    vocabulary-parallel embedding, column-parallel output head gathered to full logits."""
    s = styles or hyperpar_styles()
    return {
        "tok_embeddings": s.RowwiseParallel(input_layouts=s.Replicate()),
        "layers.*.attention.wq": s.ColwiseParallel(),
        "layers.*.attention.wk": s.ColwiseParallel(),
        "layers.*.attention.wv": s.ColwiseParallel(),
        "layers.*.attention.wo": s.RowwiseParallel(),
        "layers.*.feed_forward.w1": s.ColwiseParallel(),
        "layers.*.feed_forward.w3": s.ColwiseParallel(),
        "layers.*.feed_forward.w2": s.RowwiseParallel(),
        "output": s.ColwiseParallel(output_layouts=s.Replicate()),
    }


def tp_sp_plan(styles: SimpleNamespace | None = None, *,
               loss_parallel: bool = False) -> dict[str, Any]:
    """Tensor + sequence parallelism (the torchtitan plan): between blocks the activations are
    split along the sequence (dim 1); norms run on the local slice; each block all-gathers its
    input and reduce-scatters its output. With ``loss_parallel`` the logits stay sharded on the
    vocabulary (a DTensor) for ``loss_parallel()``."""
    s = styles or hyperpar_styles()
    return {
        "tok_embeddings": s.RowwiseParallel(input_layouts=s.Replicate(),
                                            output_layouts=s.Shard(1)),
        "norm": s.SequenceParallel(),
        "output": s.ColwiseParallel(
            input_layouts=s.Shard(1),
            output_layouts=s.Shard(-1) if loss_parallel else s.Replicate(),
            use_local_output=not loss_parallel,
        ),
        "layers.*.attention_norm": s.SequenceParallel(),
        "layers.*.attention": s.PrepareModuleInput(
            input_layouts=(s.Shard(1), None, None),
            desired_input_layouts=(s.Replicate(), None, None),
        ),
        "layers.*.attention.wq": s.ColwiseParallel(),
        "layers.*.attention.wk": s.ColwiseParallel(),
        "layers.*.attention.wv": s.ColwiseParallel(),
        "layers.*.attention.wo": s.RowwiseParallel(output_layouts=s.Shard(1)),
        "layers.*.ffn_norm": s.SequenceParallel(),
        "layers.*.feed_forward": s.PrepareModuleInput(
            input_layouts=(s.Shard(1),), desired_input_layouts=(s.Replicate(),),
        ),
        "layers.*.feed_forward.w1": s.ColwiseParallel(),
        "layers.*.feed_forward.w3": s.ColwiseParallel(),
        "layers.*.feed_forward.w2": s.RowwiseParallel(output_layouts=s.Shard(1)),
    }
