"""Neural-network ops: softmax, normalisation, attention, embedding, dropout and losses."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn import _reduction as _Reduction

from hyperpar.dtensor.placement import REPLICATE
from hyperpar.dtensor.rules import GlobalMean, MaskedLookup
from hyperpar.platform import get_platform
from hyperpar.torch.dtensor import random as _random
from hyperpar.torch.dtensor._ops.dispatch import localize
from hyperpar.torch.dtensor._ops.neutral import (
    decide,
    neutral_sharding,
    ordered_sharding,
    to_sharding,
)
from hyperpar.torch.dtensor._ops.registry import (
    OpCall,
    Sharding,
    ShardingError,
    mixing_error,
    op_name,
    register_op,
    unshard,
)
from hyperpar.torch.dtensor.api import DTensor, DTensorSpec, _wrap

R = REPLICATE


# ---------------------------------------------------------------------------- softmax & norms
@register_op(torch.softmax, torch.Tensor.softmax, F.softmax, torch.log_softmax,
             torch.Tensor.log_softmax, F.log_softmax)
def softmax_rule(call: OpCall) -> Sharding:
    """``softmax``/``log_softmax``: the neutral rule (the softmax dim gathered, others kept)."""
    dim = call.arg(1, "dim")
    if dim is None:
        raise ShardingError(f"{op_name(call.func)} on a DTensor needs an explicit dim")
    name = "log_softmax" if "log" in getattr(call.func, "__name__", "") else "softmax"
    return neutral_sharding(name, call, dim=dim)


@register_op(F.layer_norm, F.rms_norm if hasattr(F, "rms_norm") else None, F.group_norm)
def norm_rule(call: OpCall) -> Sharding:
    """``layer_norm``/``rms_norm``/``group_norm``: the neutral rules (normalised dims gathered;
    weight and bias replicated; a plain weight or bias that requires grad is refused, as
    torch's DTensor refuses mixing, a constant one is used as it is)."""
    x = call.arg(0, "input")
    if not isinstance(x, DTensor):
        raise mixing_error(call.func, x)
    # rms_norm's argument 3 is eps: never a DTensor
    affine = (call.arg(2, "weight"), call.arg(3, "bias"))
    for t in affine:
        if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) and t.requires_grad:
            # its gradient would hold only this rank's rows (MindSpore refuses it too)
            raise mixing_error(call.func, t)
    tensors = [x] + [t for t in affine if isinstance(t, DTensor)]
    if call.func is F.group_norm:
        return ordered_sharding("group_norm", call, tensors,
                                num_groups=call.arg(1, "num_groups"))
    name = "layer_norm" if call.func is F.layer_norm else "rms_norm"
    return ordered_sharding(name, call, tensors,
                            normalized_shape=call.arg(1, "normalized_shape"))


def _affine_dtensors(call: OpCall, x: object, affine: tuple) -> list:
    """``[x]`` and the DTensors among weight and bias; a plain one that requires grad refused
    (its gradient would hold only this rank's rows)."""
    if not isinstance(x, DTensor):
        raise mixing_error(call.func, x)
    for t in affine:
        if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) and t.requires_grad:
            raise mixing_error(call.func, t)
    return [x] + [t for t in affine if isinstance(t, DTensor)]


@register_op(torch.native_layer_norm)
def native_layer_norm_rule(call: OpCall) -> Sharding:
    """``native_layer_norm(x, shape, w, b, eps)`` -> (out, mean, rstd): the neutral
    ``layer_norm`` rule with its two statistics (shaped as x, normalised dims kept as 1)."""
    x = call.arg(0, "input")
    tensors = _affine_dtensors(call, x, (call.arg(2, "weight"), call.arg(3, "bias")))
    return ordered_sharding("layer_norm", call, tensors,
                            normalized_shape=call.arg(1, "normalized_shape"), stats=2)


def _local_group_norm(x, weight, bias, n, *rest, **kwargs):
    # N is the batch size, given explicitly: on a batch shard it is the local rows'
    return torch.native_group_norm(x, weight, bias, x.shape[0], *rest, **kwargs)


@register_op(torch.native_group_norm)
def native_group_norm_rule(call: OpCall) -> Sharding:
    """``native_group_norm(x, w, b, N, C, HxW, group, eps)`` -> (out, mean, rstd): the neutral
    ``group_norm`` rule with its two ``(N, group)`` statistics; a batch shard stays (run
    locally with its own ``N``)."""
    if len(call.args) < 8:
        raise ShardingError(f"{op_name(call.func)} on DTensors: pass its 8 arguments "
                            "positionally (input, weight, bias, N, C, HxW, group, eps)")
    x = call.args[0]
    tensors = _affine_dtensors(call, x, (call.args[1], call.args[2]))
    sh = ordered_sharding("group_norm", call, tensors, num_groups=call.args[6], stats=2)
    sh.local = _local_group_norm
    return sh


# ---------------------------------------------------------------------------- attention
@register_op(F.scaled_dot_product_attention)
def sdpa_rule(call: OpCall) -> Sharding:
    """``scaled_dot_product_attention``: the neutral ``sdpa`` rule (sharded on batch or heads,
    the mask follows, else replicated)."""
    q, k, v = call.arg(0, "query"), call.arg(1, "key"), call.arg(2, "value")
    mask = call.arg(3, "attn_mask")
    for t in (q, k, v, mask):
        if t is not None and not isinstance(t, DTensor):
            raise mixing_error(call.func, t)
    return ordered_sharding("sdpa", call, [q, k, v] + ([mask] if mask is not None else []))


# ---------------------------------------------------------------------------- embedding
@register_op(F.embedding)
def embedding_rule(call: OpCall) -> Sharding:
    """``F.embedding``: the neutral rule; a vocabulary-sharded table is its masked lookup
    (Partial output)."""
    ids, weight = call.args[0], call.args[1]
    if not (isinstance(ids, DTensor) and isinstance(weight, DTensor)):
        raise mixing_error(call.func, ids if not isinstance(ids, DTensor) else weight)
    res = decide("embedding", [weight._spec, ids._spec], padding_idx=call.arg(2, "padding_idx"))
    tw, ti = res.inputs
    local = None
    if isinstance(res.local, MaskedLookup):
        local = _masked_lookup(res.local, call)
    return Sharding([ti, tw], res.outputs[0], res.shapes[0], local=local)


def _masked_lookup(how: MaskedLookup, call: OpCall):
    """The torch local function of :class:`MaskedLookup`: ids outside this rank's rows look up
    row 0 and are zeroed (no gradient reaches the table through them); the padding row, on the
    rank holding it, is F.embedding's own ``padding_idx`` (its value looked up, no gradient)."""
    lo, hi = how.rows(tuple(call.mesh.shape), call.mesh.get_coordinate())
    pad = how.local_padding(lo, hi)

    def local(idx, w, *a, **k):  # keyword arguments past padding_idx (max_norm, ...) kept
        k = {**k, "padding_idx": pad}
        a = a[1:]
        shifted = idx - lo
        outside = (shifted < 0) | (shifted >= hi - lo)
        emb = F.embedding(shifted.masked_fill(outside, 0), w, *a, **k)
        return emb.masked_fill(outside.unsqueeze(-1), 0)

    return local


# ---------------------------------------------------------------------------- dropout
@register_op(F.dropout, torch.dropout, torch.Tensor.dropout if hasattr(torch.Tensor,
                  "dropout") else None, raw=True)
def _dropout(func, args, kwargs):
    """``dropout``: offset-based random mask on the local piece (Partial reduced first)."""
    x = args[0]
    p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
    training = args[2] if len(args) > 2 else kwargs.get("training", kwargs.get("train", True))
    inplace = args[3] if len(args) > 3 else kwargs.get("inplace", False)
    if not training or p == 0.0:
        return x
    spec = x._spec
    pl = unshard(spec.placements)
    out_spec = spec if pl == spec.placements else DTensorSpec(spec.mesh, pl, spec.shape)
    local = localize(x, pl, pl, True)
    shape, offset = out_spec.local_shape_and_offset()
    keep = _random.uniform_block(tuple(spec.shape), shape, offset, torch.float32,
                                 local.device) >= p
    if p == 1.0:
        result = local * 0
    else:
        result = local * keep.to(local.dtype) / (1.0 - p)
    if inplace and out_spec is spec:
        with torch.no_grad():
            x._local.copy_(result)
        return x
    return _wrap(result, out_spec)


#: the other dropouts -> their ``training`` default (alpha ones are off unless asked)
_OTHER_DROPOUT = {getattr(F, n, None): n.startswith("dropout")
                  for n in ("alpha_dropout", "feature_alpha_dropout", "dropout1d", "dropout2d",
                            "dropout3d")}
_OTHER_DROPOUT.pop(None, None)


@register_op(list(_OTHER_DROPOUT), raw=True)
def _other_dropout(func, args, kwargs):
    """``alpha_dropout``/``feature_alpha_dropout``/``dropout1d/2d/3d``: the input itself when
    not training or ``p == 0``, zeros for ``p == 1`` (as torch); a random mask of theirs is not
    written: refused."""
    x = args[0]
    p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
    training = args[2] if len(args) > 2 else kwargs.get("training", _OTHER_DROPOUT[func])
    if not training or p == 0.0:
        return x
    if p == 1.0:  # every element dropped: torch multiplies by zero (NaN stays NaN)
        return x * 0.0
    raise ShardingError(f"{op_name(func)} in training on a DTensor (p={p}, placements "
                        f"{list(x._spec.placements)}): its random mask has no DTensor rule; "
                        "use F.dropout, or call it on .to_local() (per-rank masks)")


# ---------------------------------------------------------------------------- losses
@register_op(F.cross_entropy, F.nll_loss)
def cross_entropy_rule(call: OpCall) -> Sharding:
    """``cross_entropy``/``nll_loss``: the neutral rule; a mean over a sharded batch is a local
    sum over the global count (all-reduced, of non-ignored targets; known, of samples)."""
    x, target = call.args[0], call.arg(1, "target")
    if not isinstance(target, DTensor):
        raise mixing_error(call.func, target)
    weight = call.arg(2, "weight")
    ignore_index = call.arg(4, "ignore_index", -100)
    reduction = call.arg(6, "reduction", "mean")
    size_average, reduce = call.arg(3, "size_average"), call.arg(5, "reduce")
    if size_average is not None or reduce is not None:  # torch's legacy arguments win
        reduction = _Reduction.legacy_get_string(size_average, reduce)
    specs = [x._spec, target._spec] + ([weight._spec] if isinstance(weight, DTensor) else [])
    res = decide("cross_entropy", specs, reduction=reduction, ignore_index=ignore_index)
    sh = to_sharding(res)
    if isinstance(res.local, GlobalMean) and res.local.count is not None:
        sh.local = _sum_over(call.func, res.local.count)
    elif isinstance(res.local, GlobalMean):
        sh.local = _global_mean(res.local, call.func, call.mesh, ignore_index)
    return sh


def _summed(func, a, k):
    """``func``'s keyword arguments with the reduction made a sum (positional legacy
    ``size_average``/``reduce``/``reduction`` dropped, they were read by the rule)."""
    k = {**k, "reduction": "sum"}
    for name in ("size_average", "reduce"):
        k.pop(name, None)
    names = ("weight", "size_average", "ignore_index", "reduce", "reduction", "label_smoothing")
    for name, v in zip(names, a, strict=False):
        if name not in ("size_average", "reduce", "reduction"):
            k.setdefault(name, v)
    return k


def _global_mean(how: GlobalMean, func, mesh, ignore_index: int):
    """The torch local function of :class:`GlobalMean`: the local sum divided by the count of
    non-ignored targets (class-weighted) all-reduced over ``how.dims``."""

    def local(inp, tgt, *a, **k):
        k = _summed(func, a, k)
        total = func(inp, tgt, **k)
        w = k.get("weight")
        valid = tgt != ignore_index
        if w is not None:
            count = (w[tgt.masked_fill(~valid, 0)] * valid).sum()
        else:
            count = valid.sum().to(total.dtype)
        count = count.detach().clone()
        for m in how.dims:
            get_platform().all_reduce(count, "sum", mesh.get_group(m))
        return total / count

    return local


def _sum_over(func, count: int):
    """A mean over a sharded batch of probability targets: the local sum over the global
    number of samples."""

    def local(inp, tgt, *a, **k):
        return func(inp, tgt, **_summed(func, a, k)) / count

    return local
