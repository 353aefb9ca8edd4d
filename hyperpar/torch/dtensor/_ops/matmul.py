"""Contractions (``matmul``, ``mm``, ``bmm``, ``@``, ``F.linear``) as einsums: per mesh dim the
cheapest of shard-a-kept-label, shard-the-contracted-label (output ``Partial("sum")``), one
partial operand, or all replicated."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hyperpar.dtensor.placement import REPLICATE, Shard
from hyperpar.dtensor.rules.matmul import contraction
from hyperpar.torch.dtensor._ops.registry import (
    P_SUM,
    OpCall,
    Placements,
    Sharding,
    ShardingError,
    mixing_error,
    register_op,
)
from hyperpar.torch.dtensor.api import DTensor

R = REPLICATE


# ---------------------------------------------------------------------------- matmul family
def einsum_sharding(mesh, operands: list[tuple[Placements, str, tuple[int, ...]]], out: str,
                    blocked: str = "") -> tuple[list[Placements], Placements]:
    """Placements for a contraction given by labels (``"bmk,kn->bmn"``): the framework-neutral
    :func:`hyperpar.dtensor.rules.matmul.contraction` on this mesh's dims."""
    return contraction(operands, out, mesh.ndim, blocked)


_LETTERS = "abcdefghij"


def _matmul_labels(sa: tuple, sb: tuple) -> tuple[str, str, str, str, tuple]:
    if len(sa) == 0 or len(sb) == 0:
        raise ShardingError("matmul of a 0-dim tensor")
    la = "k" if len(sa) == 1 else "mk"
    lb = "k" if len(sb) == 1 else "kn"
    ba, bb = sa[:-2] if len(sa) > 1 else (), sb[:-2] if len(sb) > 1 else ()
    nb = max(len(ba), len(bb))
    blocked = ""
    pa, pb, po = "", "", ""
    out_batch = []
    for i in range(nb):
        da = ba[i - (nb - len(ba))] if i >= nb - len(ba) else None
        db = bb[i - (nb - len(bb))] if i >= nb - len(bb) else None
        lab = _LETTERS[i]
        if da is not None and db is not None and da != db:
            # broadcast: the size-1 side may not be sharded on this dim
            big = lab
            small = lab.upper()
            blocked += small
            pa += big if da != 1 else small
            pb += big if db != 1 else small
        else:
            if da is not None:
                pa += lab
            if db is not None:
                pb += lab
        po += lab
        out_batch.append(max(d for d in (da, db) if d is not None))
    out = po + ("m" if len(sa) > 1 else "") + ("n" if len(sb) > 1 else "")
    shape = tuple(out_batch) + ((sa[-2],) if len(sa) > 1 else ()) + ((sb[-1],) if len(sb) > 1
                                                                      else ())
    return pa + la, pb + lb, out, blocked, shape


@register_op(torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm,
             torch.Tensor.mm, torch.bmm, torch.Tensor.bmm)
def matmul_rule(call: OpCall) -> Sharding:
    """``matmul``/``mm``/``bmm``/``@`` as an einsum (batch dims broadcast)."""
    a, b = call.args[0], call.args[1]
    if not (isinstance(a, DTensor) and isinstance(b, DTensor)):
        raise mixing_error(call.func, b if isinstance(a, DTensor) else a)
    sa, sb = tuple(a._spec.shape), tuple(b._spec.shape)
    la, lb, lo, blocked, shape = _matmul_labels(sa, sb)
    tg, out = einsum_sharding(call.mesh, [(a._spec.placements, la, sa),
                                          (b._spec.placements, lb, sb)], lo, blocked)
    return Sharding(tg, out, shape)


@register_op(torch.Tensor.__rmatmul__, raw=True)
def _rmatmul(func, args, kwargs):
    """``b.__rmatmul__(a)`` is ``matmul(a, b)``."""
    return torch.matmul(args[1], args[0])


@register_op(F.linear)
def linear_rule(call: OpCall) -> Sharding:
    """``F.linear`` as an einsum; the bias follows the output (added once when Partial)."""
    x, w = call.args[0], call.args[1]
    bias = call.arg(2, "bias")
    for t in (x, w, bias):
        if t is not None and not isinstance(t, DTensor):
            raise mixing_error(call.func, t)
    sx, sw = tuple(x._spec.shape), tuple(w._spec.shape)
    batch = _LETTERS[:len(sx) - 1]
    tg, out = einsum_sharding(call.mesh, [(x._spec.placements, batch + "k", sx),
                                          (w._spec.placements, "nk", sw)], batch + "n")
    shape = sx[:-1] + (sw[0],)
    if bias is not None:
        bt = []
        for o in out:
            if type(o) is Shard and o.dim == len(shape) - 1:
                bt.append(Shard(0))
            elif o == P_SUM:
                bt.append(P_SUM)  # added once: rank 0 of the mesh dim keeps it
            else:
                bt.append(R)
        tg = tg + [tuple(bt)]
    return Sharding(tg, out, shape)
