"""Cross-entropy on logits sharded along the class (vocabulary) dimension.

:func:`vocab_parallel_cross_entropy` works on this rank's slice of the logits and never
gathers them: per row it all-reduces the max, then (in one fused all-reduce) the sum of
exponentials and the target logit. Backward is local (softmax minus one-hot on the local
slice). :func:`loss_parallel` is the context manager of ``torch.distributed.tensor.parallel``:
inside it, ``F.cross_entropy`` (and ``nn.CrossEntropyLoss``) on a DTensor sharded on the class
dimension runs this kernel -- a scoped override of the DTensor op table
(:data:`LOSS_PARALLEL_RULES`, an :class:`~hyperpar.torch.dtensor._ops.OpOverlay`), not a mode.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from hyperpar.parallel.loss_plan import (
    check_loss_args,
    check_loss_shapes,
    flatten_outside_shard,
    loss_parallel_shard,
)
from hyperpar.platform import get_platform
from hyperpar.torch.dtensor._ops import OpEntry, OpOverlay, register_op
from hyperpar.torch.dtensor._ops.dispatch import call_entry
from hyperpar.torch.parallel._comm import Group


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-row loss ``(1-eps) w[t] (lse - x_t) + eps/C sum_c w_c (lse - x_c)`` (``w``: class
    weights, 1 when not given; ``eps``: label smoothing) on a class-sharded ``[rows, C_local]``
    slice; ignored rows give 0. One all-reduce of the row max, one fused all-reduce of the
    sums; backward is local."""

    @staticmethod
    def forward(ctx, logits, target, vocab_start, ignore_index, group, weight, smoothing,
                classes):
        platform = get_platform()
        logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
        rows, local_vocab = logits.shape
        row_max = logits.max(dim=-1).values if local_vocab else logits.new_full((rows,), -1e30)
        platform.all_reduce(row_max, "max", group)
        shifted = logits - row_max.unsqueeze(-1)
        local_target = target - vocab_start
        outside = (local_target < 0) | (local_target >= local_vocab)
        local_target = local_target.masked_fill(outside, 0)
        exp = shifted.exp()
        local_w = None if weight is None else weight[vocab_start:vocab_start + local_vocab]
        stats = torch.zeros((3 if smoothing else 2, rows), dtype=logits.dtype,
                            device=logits.device)
        if local_vocab:
            stats[0] = shifted.gather(1, local_target.unsqueeze(1)).squeeze(1)
            stats[0].masked_fill_(outside, 0.0)
            torch.sum(exp, dim=-1, out=stats[1])
            if smoothing:
                stats[2] = (shifted if local_w is None else shifted * local_w).sum(dim=-1)
        platform.all_reduce(stats, "sum", group)
        target_logit, sum_exp = stats[0], stats[1]
        ignored = target == ignore_index
        lse = sum_exp.log()
        w_t = (torch.ones_like(lse) if weight is None
               else weight.to(lse.dtype)[target.masked_fill(ignored, 0)])
        w_t = w_t.masked_fill(ignored, 0.0)
        loss = (1.0 - smoothing) * w_t * (lse - target_logit)
        w_sum = float(classes) if weight is None else float(weight.sum())
        if smoothing:
            loss = loss + (smoothing / classes) * (lse * w_sum - stats[2])
        loss = loss.masked_fill(ignored, 0.0)
        exp.div_(sum_exp.unsqueeze(-1))  # softmax, kept for backward
        ctx.save_for_backward(exp, local_target, outside, ignored, w_t)
        ctx.args = (local_w, smoothing, classes, w_sum)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, outside, ignored, w_t = ctx.saved_tensors
        local_w, smoothing, classes, w_sum = ctx.args
        # d loss_i / d x_c = p_c ((1-eps) w_t + eps W / C) - (1-eps) w_t [c == t] - eps w_c / C
        scale_p = (1.0 - smoothing) * w_t + (smoothing * w_sum / classes)
        grad = softmax * scale_p.unsqueeze(-1)
        if grad.shape[1]:
            rows = torch.arange(grad.shape[0], device=grad.device)
            grad[rows, local_target] -= (1.0 - smoothing) * w_t * (~outside).to(grad.dtype)
            if smoothing:
                w = 1.0 if local_w is None else local_w.to(grad.dtype).unsqueeze(0)
                grad -= (smoothing / classes) * w
        scale = grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1)
        return grad.mul_(scale), None, None, None, None, None, None, None


def vocab_parallel_cross_entropy(
    local_logits: torch.Tensor, target: torch.Tensor, *, vocab_start: int | None = None,
    group: Group = None, ignore_index: int = -100, reduction: str = "mean",
    weight: torch.Tensor | None = None, label_smoothing: float = 0.0,
    num_classes: int | None = None,
) -> torch.Tensor:
    """Cross-entropy of logits whose class dimension (dim 1, as in ``F.cross_entropy``) is
    split over the ranks of ``group``; ``local_logits`` is this rank's slice.

    ``local_logits``: ``[N, V_local]`` or ``[N, V_local, d1, ...]``; ``target``: the full
    class indices ``[N]`` / ``[N, d1, ...]`` (replicated). ``vocab_start`` is the first class
    held here (default ``rank * V_local``, i.e. an even split); ``num_classes`` the full class
    count (default ``V_local`` times the group size). ``weight`` (the full ``[C]`` class
    weights, replicated), ``label_smoothing``, ``ignore_index`` and ``reduction`` mean what
    they mean in ``F.cross_entropy``. Returns the same value on every rank; the gradient
    w.r.t. ``local_logits`` is this rank's slice of the full gradient.
    """
    check_loss_args(reduction, label_smoothing)
    if local_logits.dim() < 2:
        raise ValueError(
            f"vocab-parallel cross-entropy needs logits with a class dim 1, got shape "
            f"{tuple(local_logits.shape)}"
        )
    platform = get_platform()
    if vocab_start is None:
        vocab_start = platform.rank(group) * local_logits.shape[1]
    if num_classes is None:
        num_classes = local_logits.shape[1] * platform.world_size(group)
    shape = (local_logits.shape[0], num_classes, *local_logits.shape[2:])  # the global one
    check_loss_shapes(shape, 1, tuple(target.shape),
                      None if weight is None else tuple(weight.shape))
    flat_logits = local_logits.movedim(1, -1).reshape(-1, local_logits.shape[1])
    flat_target = target.reshape(-1)
    losses = _VocabParallelCrossEntropy.apply(flat_logits, flat_target, vocab_start,
                                              ignore_index, group, weight,
                                              float(label_smoothing), int(num_classes))
    if reduction == "none":
        return losses.view(target.shape).to(local_logits.dtype)
    total = losses.sum()
    if reduction == "sum":
        return total.to(local_logits.dtype)
    kept = flat_target != ignore_index
    if weight is None:
        denom = kept.sum()
    else:
        denom = weight.to(total.dtype)[flat_target.masked_fill(~kept, 0)].masked_fill(
            ~kept, 0.0).sum()
    return (total / denom).to(local_logits.dtype)


def _sharded_class_dim(logits: Any) -> tuple[int, Group, int] | None:
    """``(mesh_dim, group, vocab_start)`` if ``logits`` is a DTensor sharded on dim 1 over
    exactly one mesh dimension (replicated elsewhere); ``None`` for a plain tensor and for
    layouts the per-op rule computes; raises on the layouts torch's ``loss_parallel`` refuses
    (the plan: :func:`hyperpar.parallel.loss_plan.loss_parallel_shard`)."""
    from hyperpar.dtensor import DTensor

    if not isinstance(logits, DTensor):
        return None
    mesh = logits.device_mesh
    coord = mesh.get_coordinate()
    found = None if coord is None else loss_parallel_shard(  # raises on what torch refuses
        tuple(logits.placements), tuple(logits.shape), tuple(mesh.shape), coord)
    if found is None:
        return None
    return found.mesh_dim, mesh.get_group(found.mesh_dim), found.start


#: The rules ``loss_parallel`` swaps into the DTensor op table while it is entered.
LOSS_PARALLEL_RULES = OpOverlay("loss_parallel")
_CE_ARGS = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction",
            "label_smoothing")


@register_op(F.cross_entropy, overlay=LOSS_PARALLEL_RULES)
def vocab_parallel_cross_entropy_rule(func: Any, args: tuple, kwargs: dict,
                                      under: OpEntry | None) -> Any:
    """``cross_entropy`` on logits sharded on the class dim: the vocab-parallel kernel, the
    logits are never gathered (other layouts: the rule underneath)."""
    bound = dict(zip(_CE_ARGS, args, strict=False))
    bound.update(kwargs)
    found = _sharded_class_dim(bound.get("input"))
    if found is None:
        return call_entry(under, func, args, kwargs)
    return _cross_entropy_on_dtensor(found, **bound)


@register_op(torch.flatten, torch.Tensor.flatten, overlay=LOSS_PARALLEL_RULES)
def flatten_outside_shard_rule(func: Any, args: tuple, kwargs: dict,
                               under: OpEntry | None) -> Any:
    """``logits.flatten(0, 1)`` keeps a 1-D mesh's shard outside the flattened range (local
    flatten, shard dim renumbered); anything else: the rule underneath."""
    out = _flatten_outside_shard(*args, **kwargs) if args else None
    return out if out is not None else call_entry(under, func, args, kwargs)


def _flatten_outside_shard(x: Any, start_dim: int = 0, end_dim: int = -1) -> Any:
    """``logits.flatten(0, 1)`` on a DTensor sharded on a dim outside the flattened range
    (the vocabulary): flatten the local shard and keep the shard on the renumbered dim (the
    plan: :func:`hyperpar.parallel.loss_plan.flatten_outside_shard`)."""
    from hyperpar.dtensor import DTensor

    if not isinstance(x, DTensor) or x.device_mesh.ndim != 1:
        return None
    plan = flatten_outside_shard(x.placements, tuple(x.shape), start_dim, end_dim)
    if plan is None:
        return None
    placements, shape = plan
    local = x.to_local().flatten(start_dim % x.dim(), end_dim % x.dim())
    return DTensor.from_local(local, x.device_mesh, placements, shape=shape)


def _cross_entropy_on_dtensor(found: tuple[int, Group, int], input: Any, target: Any,
                              weight: Any = None, size_average: Any = None,
                              ignore_index: int = -100, reduce: Any = None,
                              reduction: str = "mean", label_smoothing: float = 0.0) -> Any:
    from hyperpar.dtensor import DTensor, Replicate

    if size_average is not None or reduce is not None:
        raise NotImplementedError("loss_parallel: use reduction=, not size_average/reduce")
    _, group, start = found
    local = input.to_local()
    if isinstance(target, DTensor):
        target = target.full_tensor()
    if isinstance(weight, DTensor):
        weight = weight.full_tensor()
    loss = vocab_parallel_cross_entropy(local, target, vocab_start=start, group=group,
                                        ignore_index=ignore_index, reduction=reduction,
                                        weight=weight, label_smoothing=label_smoothing,
                                        num_classes=input.shape[1])
    # The loss is a DTensor replicated over the logits' mesh for every reduction, as torch's:
    # a script goes on with ``loss.placements`` / ``full_tensor()``; ``loss.backward()`` on the
    # scalar seeds a replicated gradient of 1 (every rank holds the same value).
    mesh = input.device_mesh
    return DTensor.from_local(loss, mesh, (Replicate(),) * mesh.ndim, run_check=False,
                              shape=tuple(loss.shape))


@contextlib.contextmanager
def loss_parallel() -> Iterator[None]:
    """Inside this context, ``F.cross_entropy`` / ``nn.CrossEntropyLoss`` on a DTensor sharded
    on the class dimension (dim 1; for ``[N, C]`` logits ``Shard(-1)`` too) computes the loss
    without gathering the logits (:func:`vocab_parallel_cross_entropy`).

    Class ``weight``, ``label_smoothing``, ``ignore_index`` and every ``reduction`` are
    supported, forward and backward. The loss is a DTensor replicated over the logits' mesh,
    as in ``torch.distributed.tensor.parallel.loss_parallel``: per-element losses for
    ``reduction="none"``, a scalar for ``"mean"``/``"sum"`` (``loss.item()`` works on it,
    ``loss.backward()`` seeds a replicated 1). Unlike torch, whose backward must run inside
    the context, hyperpar's backward is local and may also run outside it. Other inputs pass
    through.
    """
    with LOSS_PARALLEL_RULES.active():
        yield
