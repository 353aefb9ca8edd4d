"""``loss_parallel`` on MindSpore: cross-entropy on vocabulary-sharded logits without gathering
the vocabulary (torch's ``torch.distributed.tensor.parallel.loss_parallel``).

Inside ``with loss_parallel():`` -- which may wrap the whole ``value_and_grad`` call --
``mindspore.ops.cross_entropy`` given a logits DTensor sharded on its class dim (the output of
``ColwiseParallel(use_local_output=False)`` on the head) computes on each rank's columns only:
the local max and sum of exponentials are all-reduced (max, then sum), and so is the target's
logit, which exactly one rank holds. The loss is replicated on every rank (a plain tensor); the
gradient of each rank's logits is its columns of ``softmax - one_hot``, with no communication.
Logits sharded on the class dim and on another dim by other mesh dims (batch-sharded for data
parallel) go to the per-op DTensor ``cross_entropy``; DTensor logits whose classes are not
sharded are refused, as torch refuses them (:func:`~hyperpar.parallel.loss_plan.
loss_parallel_shard`, the one decision). Plain tensors go to MindSpore's own
``cross_entropy``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from mindspore import Tensor, ops

from hyperpar.parallel.loss_plan import (
    ClassShard,
    check_loss_args,
    check_loss_shapes,
    loss_parallel_shard,
)
from hyperpar.parallel.spec import Comm
from hyperpar.platform import get_platform

from .comm import Boundary
from .redistribute import mesh_coordinate
from .tensors import copy_tensor

__all__ = ["loss_parallel", "vocab_parallel_cross_entropy"]


def vocab_parallel_cross_entropy(logits: Any, target: Any, weight: Any = None,
                                 ignore_index: int = -100, reduction: str = "mean",
                                 label_smoothing: float = 0.0) -> Tensor:
    """``ops.cross_entropy(logits, target, ...)`` for a DTensor ``logits`` sharded on its class
    dim over a 1-D mesh (uneven pieces as ``torch.chunk`` cuts them); ``target`` holds class
    ids, replicated, with the shape of ``logits`` without the class dim; ``weight`` (one value
    per class, whole), ``label_smoothing``, ``ignore_index`` and ``reduction`` mean what they
    mean in ``ops.cross_entropy`` (torch's formula: a row's loss is
    ``(1-eps) w_t (lse - x_t) + eps/C sum_c w_c (lse - x_c)``; a mean divides by the summed
    ``w_t`` of the rows kept). Returns the loss, the same on every rank. Another mesh dim
    may replicate the logits (the class shard's group computes)."""
    from .dtensor import DTensor

    check_loss_args(reduction, label_smoothing)
    mesh = logits.device_mesh
    shape = tuple(logits.shape)
    found = _class_shard(logits)
    if found is None:  # the per-op DTensor cross_entropy's case (loss_parallel routes it)
        raise ValueError(f"vocab_parallel_cross_entropy needs logits whose mesh dims other "
                         f"than the class shard's replicate them, got placements "
                         f"{logits.placements}; call ops.cross_entropy")
    c, start, length = found.dim, found.start, found.length
    # a DTensor target/weight is gathered only once its global shape is known to be right
    check_loss_shapes(shape, c, tuple(target.shape),
                      None if weight is None else tuple(weight.shape))
    if isinstance(target, DTensor):
        target = target.full_tensor()
    if isinstance(weight, DTensor):
        weight = weight.full_tensor()
    platform = get_platform()
    group = mesh.get_group(found.mesh_dim)
    local = logits.to_local()

    # the global max over the classes, for a stable exp (no gradient: softmax ignores a shift)
    top = copy_tensor(ops.stop_gradient(local.max(axis=c, keepdims=True)))
    platform.all_reduce(top, "max", group)
    shifted = local - top
    # each rank's sum is a partial sum of the one the loss needs; the loss is replicated, so the
    # sum's gradient arrives whole on every rank (all-reduce forward, nothing backward)
    total = Boundary(platform, Comm("all_reduce", "none"), group, "loss_parallel sum-exp")
    sum_exp = total(ops.exp(shifted).sum(axis=c))
    ids = target.astype(ms_int())
    valid = ids != ignore_index
    mine = valid & (ids >= start) & (ids < start + length)
    local_ids = (ids - start) * mine.astype(ids.dtype)  # others' ids: any index, masked below
    picked = ops.gather_elements(shifted, c, local_ids.expand_dims(c)).squeeze(c)
    picked = picked * mine.astype(picked.dtype)  # only the rank holding the class adds it
    target_logit = Boundary(platform, Comm("all_reduce", "none"), group,
                            "loss_parallel target logit")(picked)
    kept = valid.astype(picked.dtype)
    lse = ops.log(sum_exp)
    # w_t: the target's class weight (1 without weights), 0 on ignored rows
    w_t = kept if weight is None else weight.astype(picked.dtype)[ids * valid.astype(
        ids.dtype)] * kept
    loss = (1.0 - label_smoothing) * w_t * (lse - target_logit)
    if label_smoothing:
        classes = shape[c]
        local_w = None if weight is None else weight.astype(picked.dtype)[start:start + length]
        weighted = shifted if local_w is None else shifted * _along(local_w, c, shifted.ndim)
        smooth_sum = Boundary(platform, Comm("all_reduce", "none"), group,
                              "loss_parallel smoothing sum")(weighted.sum(axis=c))
        w_total = float(classes) if weight is None else weight.astype(picked.dtype).sum()
        loss = loss + (label_smoothing / classes) * (lse * w_total - smooth_sum) * kept
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / w_t.sum()


def _class_shard(logits: Any) -> ClassShard | None:
    """The neutral decision (:func:`~hyperpar.parallel.loss_plan.loss_parallel_shard`): the
    class shard of ``logits``, ``None`` for the per-op rule's layouts; raises on the rest."""
    mesh = logits.device_mesh
    return loss_parallel_shard(tuple(logits.placements), tuple(logits.shape),
                               tuple(mesh.shape), mesh_coordinate(mesh))


def _along(v: Any, dim: int, ndim: int) -> Any:
    """The 1-D ``v`` shaped to broadcast along ``dim`` of an ``ndim``-D tensor."""
    return v.reshape(tuple(-1 if d == dim else 1 for d in range(ndim)))


def ms_int() -> Any:
    """The id dtype the gather takes."""
    import mindspore as ms

    return ms.int32


# Where MindSpore's cross_entropy is looked up at call time: ops, ops.function, nn_func.
def _homes() -> list[Any]:
    import mindspore.ops.function as function
    import mindspore.ops.function.nn_func as nn_func

    return [ops, function, nn_func]


@contextlib.contextmanager
def loss_parallel() -> Iterator[None]:
    """Within the block, ``mindspore.ops.cross_entropy`` on vocabulary-sharded logits DTensors
    runs :func:`vocab_parallel_cross_entropy`; any other input runs MindSpore's own."""
    from .dtensor import DTensor

    homes = [(home, home.cross_entropy) for home in _homes()]
    original = homes[0][1]

    def cross_entropy(input: Any, target: Any, weight: Any = None, ignore_index: int = -100,
                      reduction: str = "mean", label_smoothing: float = 0.0) -> Any:
        if isinstance(input, DTensor) and _class_shard(input) is not None:
            return vocab_parallel_cross_entropy(input, target, weight, ignore_index, reduction,
                                                label_smoothing)
        return original(input, target, weight, ignore_index, reduction, label_smoothing)

    for home, _ in homes:
        home.cross_entropy = cross_entropy
    try:
        yield
    finally:
        for home, fn in homes:
            home.cross_entropy = fn
