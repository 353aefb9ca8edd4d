"""Neural-network ops: softmax, normalisation, attention, embedding, dropout and losses."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hyperpar.dtensor.placement import REPLICATE, Shard
from hyperpar.platform import get_platform
from hyperpar.torch.dtensor import random as _random
from hyperpar.torch.dtensor._ops.dispatch import localize
from hyperpar.torch.dtensor._ops.neutral import neutral_sharding, ordered_sharding
from hyperpar.torch.dtensor._ops.registry import (
    P_SUM,
    OpCall,
    Placements,
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
    weight and bias replicated; a plain weight or bias is used as it is)."""
    x = call.arg(0, "input")
    if not isinstance(x, DTensor):
        raise mixing_error(call.func, x)
    # rms_norm's argument 3 is eps: never a DTensor
    tensors = [x] + [t for t in (call.arg(2, "weight"), call.arg(3, "bias"))
                     if isinstance(t, DTensor)]
    if call.func is F.group_norm:
        return ordered_sharding("group_norm", call, tensors,
                                num_groups=call.arg(1, "num_groups"))
    name = "layer_norm" if call.func is F.layer_norm else "rms_norm"
    return ordered_sharding(name, call, tensors,
                            normalized_shape=call.arg(1, "normalized_shape"))


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
    """``F.embedding``: weight Shard(1) shards the output; Shard(0) is a vocab-parallel masked
    lookup (Partial)."""
    ids, weight = call.args[0], call.args[1]
    if not (isinstance(ids, DTensor) and isinstance(weight, DTensor)):
        raise mixing_error(call.func, ids if not isinstance(ids, DTensor) else weight)
    nd = ids.ndim
    ti, tw, out = [], [], []
    vocab_dims = []
    for m in range(call.mesh.ndim):
        pi, pw = ids._spec.placements[m], weight._spec.placements[m]
        if pw == Shard(1):
            ti.append(R)
            tw.append(pw)
            out.append(Shard(nd))
        elif pw == Shard(0) and type(pi) is not Shard:
            ti.append(R)
            tw.append(pw)
            out.append(P_SUM)
            vocab_dims.append(m)
        else:
            pi = pi if type(pi) is Shard else R
            ti.append(pi)
            tw.append(R)
            out.append(pi)
    shape = tuple(ids._spec.shape) + (weight._spec.shape[1],)
    local = None
    if vocab_dims:
        wspec = DTensorSpec(call.mesh, tuple(tw), weight._spec.shape)
        (rows, _), (offset, _) = wspec.local_shape_and_offset()
        padding_idx = call.arg(2, "padding_idx")

        def local(idx, w, *a, **k):  # vocab-parallel lookup: rows outside this shard give 0
            shifted = idx - offset
            outside = (shifted < 0) | (shifted >= rows)
            emb = F.embedding(shifted.masked_fill(outside, 0), w)
            if padding_idx is not None:
                outside = outside | (idx == padding_idx % weight._spec.shape[0])
            return emb.masked_fill(outside.unsqueeze(-1), 0)
    return Sharding([tuple(ti), tuple(tw)], tuple(out), shape, local=local)


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


# ---------------------------------------------------------------------------- losses
@register_op(F.cross_entropy, F.nll_loss)
def cross_entropy_rule(call: OpCall) -> Sharding:
    """``cross_entropy``/``nll_loss``: class dim gathered; a sharded batch gives Partial(sum) over
    the global count."""
    x, target = call.args[0], call.arg(1, "target")
    if not isinstance(target, DTensor):
        raise mixing_error(call.func, target)
    weight = call.arg(2, "weight")
    ignore_index = call.kwargs.get("ignore_index", -100)
    reduction = call.kwargs.get("reduction", "mean")
    if len(call.args) > 5 and call.func is F.cross_entropy:
        ignore_index = call.args[4]
    class_dim = 1 if x.ndim > 1 else 0
    tx, tt = [], []
    for m in range(call.mesh.ndim):
        p = x._spec.placements[m]
        if type(p) is Shard and p.dim != class_dim:
            tdim = p.dim if p.dim == 0 else p.dim - 1
            tx.append(p)
            tt.append(Shard(tdim))
        else:
            tx.append(R)
            tt.append(R)
    sharded = [m for m, p in enumerate(tx) if type(p) is Shard and call.mesh.shape[m] > 1]
    targets: list[Placements | None] = [tuple(tx), tuple(tt)]
    if isinstance(weight, DTensor):
        targets.append((R,) * call.mesh.ndim)
    tshape = tuple(target._spec.shape)
    if reduction == "none":
        out = tuple(p if type(p) is Shard else R for p in tt)
        return Sharding(targets, out, tshape)
    out = tuple(P_SUM if m in sharded else R for m in range(call.mesh.ndim))
    if reduction == "sum" or not sharded:
        return Sharding(targets, out, ())
    func = call.func
    mesh = call.mesh

    def local(inp, tgt, *a, **k):  # mean over a sharded batch: local sum / global count
        k = dict(k)
        k["reduction"] = "sum"
        total = func(inp, tgt, *a, **k)
        w = k.get("weight", a[0] if a else None)
        valid = tgt != ignore_index
        if w is not None:
            count = (w[tgt.masked_fill(~valid, 0)] * valid).sum()
        else:
            count = valid.sum().to(total.dtype)
        count = count.detach().clone()
        for m in sharded:
            get_platform().all_reduce(count, "sum", mesh.get_group(m))
        return total / count

    return Sharding(targets, out, (), local=local)
