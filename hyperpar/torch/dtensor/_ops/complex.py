"""Complex views and ``gather``: what rotary embeddings (rope) call on DTensors.

``view_as_complex`` pairs the last dim (size 2) into one complex element, so that dim must be
whole on each rank; ``view_as_real`` adds it back. Both are views, linear in their input:
other shards and Partial sums carry through. ``gather`` keeps a shard only where input and
index are sharded alike on a dim other than the gather dim (rows then line up locally).
"""

from __future__ import annotations

import torch

from hyperpar.dtensor.placement import REPLICATE, Shard
from hyperpar.torch.dtensor._ops.registry import OpCall, Sharding, mixing_error, register_op

R = REPLICATE


def _as_complex_local(t: torch.Tensor) -> torch.Tensor:
    # a shard of a non-leading dim may be a strided view; view_as_complex needs unit stride
    return torch.view_as_complex(t if t.stride(-1) == 1 else t.contiguous())


@register_op(torch.view_as_complex)
def view_as_complex_rule(call: OpCall) -> Sharding:
    """``view_as_complex``: the last (size-2) dim gathered; other shards and Partial kept."""
    spec = call.dtensors[0]._spec
    last = len(spec.shape) - 1
    pl = tuple(R if type(p) is Shard and p.dim == last else p for p in spec.placements)
    return Sharding([pl], pl, local=_as_complex_local)


@register_op(torch.view_as_real)
def view_as_real_rule(call: OpCall) -> Sharding:
    """``view_as_real``: every shard and Partial kept (a new trailing dim of size 2)."""
    pl = call.dtensors[0]._spec.placements
    return Sharding([None], pl)


@register_op(torch.gather, torch.Tensor.gather)
def gather_rule(call: OpCall) -> Sharding:
    """``gather(input, dim, index)``: a mesh dim stays sharded where input and index are both
    ``Shard(d)``, ``d != dim``, of equal size along ``d``; elsewhere both are replicated.
    The output is laid out as the index."""
    x = call.args[0]
    dim = call.arg(1, "dim")
    index = call.arg(2, "index")
    if len(call.dtensors) != 2 or not isinstance(index, type(x)):
        raise mixing_error(call.func, index)
    xs, ixs = x._spec, index._spec
    ndim = len(xs.shape)
    dim = dim % ndim if ndim else 0
    pin, pidx = [], []
    for a, b in zip(xs.placements, ixs.placements, strict=True):
        keep = (type(a) is Shard and a == b and a.dim != dim
                and xs.shape[a.dim] == ixs.shape[a.dim])
        pin.append(a if keep else R)
        pidx.append(b if keep else R)
    return Sharding([tuple(pin), tuple(pidx)], tuple(pidx))
