"""Attention: ``sdpa`` (scaled dot-product attention) on ``query``, ``key``, ``value`` shaped
``(*batch, heads, L, E)`` / ``(*batch, heads, S, E)`` / ``(*batch, heads, S, Ev)`` and an
optional ``attn_mask`` broadcastable to ``(*batch, heads, L, S)``, in that order.

Each head attends within its batch entry: a shard of a batch dim, or of the heads when every
input's head count divides by the mesh dim (so grouped key/value heads pair up with their
queries), is kept on all three inputs and the output; the mask follows where it has that dim
in full, else it is replicated. Sequence or feature shards, Partial inputs and uneven heads are
gathered (context parallelism is the styles' job)."""

from __future__ import annotations

from typing import Any

from ..placement import REPLICATE, Placement, Shard
from .base import OpSharding, TensorMeta, rule


def _kept_shard(q: TensorMeta, k: TensorMeta, v: TensorMeta, m: int, size: int) -> Placement:
    """The shard of mesh dim ``m`` (of ``size``) that q, k and v can all keep, else Replicate:
    the first of q's, k's, v's placements there that shards a batch dim all three have in
    full, or the heads dim with every head count divisible by ``size``."""
    nd = len(q.shape)
    heads = nd - 3
    for t in (q, k, v):
        p = t.placements[m]
        if type(p) is not Shard or p.dim >= nd - 2:
            continue
        if p.dim == heads:
            if all(x.shape[heads] % size == 0 for x in (q, k, v)):
                return p
        elif all(x.shape[p.dim] == q.shape[p.dim] for x in (k, v)):
            return p
    return REPLICATE


@rule("sdpa")
def _sdpa(op: str, metas: tuple[TensorMeta, ...], mesh_shape: tuple[int, ...],
          **_: Any) -> OpSharding:
    """Batch or heads shards kept (the mask following), everything else replicated."""
    q, k, v = metas[:3]
    mask = metas[3] if len(metas) > 3 else None
    nd = len(q.shape)
    chosen = tuple(_kept_shard(q, k, v, m, size) for m, size in enumerate(mesh_shape))
    targets = [chosen, chosen, chosen]
    if mask is not None:
        lead = nd - len(mask.shape)  # the mask's dims align with q's last ones
        tm: list[Placement] = []
        for c in chosen:
            follows = (type(c) is Shard and c.dim >= lead
                       and mask.shape[c.dim - lead] == q.shape[c.dim])
            tm.append(Shard(c.dim - lead) if follows else REPLICATE)
        targets.append(tuple(tm))
    shape = (*q.shape[:-1], v.shape[-1])
    return OpSharding(tuple(targets), (chosen,), (shape,))
