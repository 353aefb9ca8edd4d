"""Contractions (``matmul``, ``mm``, ``bmm``, ``@``, ``F.linear``): torch's functions mapped
onto the neutral ``matmul`` and ``linear`` rules (:mod:`hyperpar.dtensor.rules.matmul`: per
mesh dim the cheapest of shard-a-kept-label, shard-the-contracted-label (output
``Partial("sum")``), one partial operand, or all replicated)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hyperpar.dtensor.rules.matmul import contraction
from hyperpar.torch.dtensor._ops.neutral import neutral_sharding
from hyperpar.torch.dtensor._ops.registry import (
    OpCall,
    Placements,
    Sharding,
    mixing_error,
    register_op,
)
from hyperpar.torch.dtensor.api import DTensor


def einsum_sharding(mesh, operands: list[tuple[Placements, str, tuple[int, ...]]], out: str,
                    blocked: str = "") -> tuple[list[Placements], Placements]:
    """Placements for a contraction given by labels (``"bmk,kn->bmn"``): the framework-neutral
    :func:`hyperpar.dtensor.rules.matmul.contraction` on this mesh's dims."""
    return contraction(operands, out, mesh.ndim, blocked)


@register_op(torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm,
             torch.Tensor.mm, torch.bmm, torch.Tensor.bmm)
def matmul_rule(call: OpCall) -> Sharding:
    """``matmul``/``mm``/``bmm``/``@``: the neutral ``matmul`` rule (vectors, broadcast batch
    dims)."""
    a, b = call.args[0], call.args[1]
    if not (isinstance(a, DTensor) and isinstance(b, DTensor)):
        raise mixing_error(call.func, b if isinstance(a, DTensor) else a)
    return neutral_sharding("matmul", call)


@register_op(torch.Tensor.__rmatmul__, raw=True)
def _rmatmul(func, args, kwargs):
    """``b.__rmatmul__(a)`` is ``matmul(a, b)``."""
    return torch.matmul(args[1], args[0])


@register_op(F.linear)
def linear_rule(call: OpCall) -> Sharding:
    """``F.linear``: the neutral ``linear`` rule; the bias follows the output (added once when
    Partial)."""
    x, w = call.args[0], call.args[1]
    bias = call.arg(2, "bias")
    for t in (x, w, bias):
        if t is not None and not isinstance(t, DTensor):
            raise mixing_error(call.func, t)
    return neutral_sharding("linear", call)
