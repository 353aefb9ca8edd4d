"""MindSpore implementations of the neutral local computations a rule may ask for
(``OpSharding.local``, see :mod:`hyperpar.dtensor.rules.base`): the vocabulary-parallel masked
lookup and the mean loss over a sharded batch. They run on local tensors, inside the dispatch's
``NoFallbackGuard``; torch builds the same computations in ``hyperpar.torch.dtensor._ops.nn``."""

from __future__ import annotations

from typing import Any

from mindspore import Tensor, mint, ops

from hyperpar.dtensor.placement import REPLICATE
from hyperpar.dtensor.rules import P_SUM, GlobalMean, MaskedLookup

from .redistribute import mesh_coordinate, redistribute, sum_grad_over

#: Where ``reduction`` sits in a normalised cross_entropy / nll_loss call
#: ``(input, target, weight, ignore_index, reduction, label_smoothing)``.
REDUCTION_AT = 4


def masked_lookup(run: Any, local: list[Any], tensors: tuple[int, ...], how: MaskedLookup,
                  mesh: Any, padding_at: int | None) -> Tensor:
    """``run(local)`` (a ``Gather`` / ``Embedding`` call) on this rank's rows ``[lo, hi)``:
    ids outside look up row 0 and their output is zeroed (so no gradient reaches the table
    through them); ``local[padding_at]``, where the call takes a padding index, becomes this
    rank's row of it (None where another rank holds it)."""
    lo, hi = how.rows(tuple(mesh.shape), mesh_coordinate(mesh))
    ids = local[tensors[1]]
    shifted = ids - lo
    keep = mint.logical_and(shifted >= 0, shifted < hi - lo)
    args = list(local)
    args[tensors[1]] = shifted * keep.astype(shifted.dtype)
    if padding_at is not None:
        args[padding_at] = how.local_padding(lo, hi)
    out = run(args)
    return out * keep.expand_dims(-1).astype(out.dtype)


def global_mean(func: Any, local: list[Any], how: GlobalMean, mesh: Any) -> Tensor:
    """A mean cross entropy / nll loss over a sharded batch: this rank's summed loss divided by
    the count of non-ignored targets (class-weighted) summed over ``how.dims``. The count is
    all-reduced differentiably (a Partial-to-Replicate redistribution whose gradient is summed
    back over ``how.dims``), so a class weight's gradient, which MindSpore computes through the
    count, stays right. A known ``how.count`` (probability targets) is used as it is."""
    args = list(local)
    args[REDUCTION_AT] = "sum"
    total = func(*args)
    if how.count is not None:
        return total / how.count
    target, weight = local[1], local[2]
    valid = target != how.ignore_index
    if weight is None:
        counted = valid.astype(total.dtype)
    else:
        counted = ops.gather(weight, target * valid.astype(target.dtype), 0) \
            * valid.astype(weight.dtype)
    count = counted.sum()
    src = tuple(P_SUM if m in how.dims else REPLICATE for m in range(mesh.ndim))
    count = redistribute(count, mesh, src, (REPLICATE,) * mesh.ndim, ())
    return total / sum_grad_over(count, mesh, how.dims)
