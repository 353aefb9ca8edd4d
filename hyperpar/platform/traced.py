"""Collectives that ``torch.compile`` can trace: torch's functional collectives.

Inside a compiled region (``torch.compiler.is_compiling()``), :class:`TorchPlatform` runs its
bulk collectives through these functions instead of the in-place ``torch.distributed`` calls.
Functional collectives return a new tensor; Dynamo records them as graph nodes (issue + wait),
so a compiled step has no graph break at a tensor-parallel boundary and the compiler may
schedule the communication. The in-place contract of the Platform methods is kept by copying
the result into the caller's buffer: on a buffer the graph itself allocated, functionalisation
removes that copy.

Not traced: the health instrumentation (collective counting, culprit attribution and the
``HYPERPAR_DEBUG_COLLECTIVES`` check need the store and wall-clock time, which a graph cannot
hold). A hang inside a compiled graph is reported by the backend's own timeout.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

Group = Any

# Platform op name -> functional-collective op name.
_FUNCOL_OPS = {"sum": "sum", "avg": "avg", "max": "max", "min": "min", "product": "product"}


def compiling() -> bool:
    """True while Dynamo traces the caller (a constant in the traced code)."""
    return torch.compiler.is_compiling()


def _group(group: Group) -> Any:
    return dist.group.WORLD if group is None else group


def _op(op: str, native: bool) -> tuple[str, bool]:
    """``(functional op, divide afterwards)``: a non-native ``avg`` runs as sum then divide."""
    if native:
        return _FUNCOL_OPS[op], False
    if op != "avg":
        raise NotImplementedError(f"reduce op {op!r} has no traceable fallback")
    return "sum", True


def all_reduce(tensor: torch.Tensor, op: str, group: Group, native: bool) -> None:
    """In-place all-reduce of ``tensor``, traceable."""
    name, divide = _op(op, native)
    out = funcol.all_reduce(tensor, name, _group(group))
    if divide:
        out = out / dist.get_world_size(group)
    tensor.copy_(out)


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group: Group) -> None:
    """Every rank's ``input`` concatenated along dim 0 into ``output`` (flat), traceable."""
    out = funcol.all_gather_tensor(input.contiguous(), 0, _group(group))
    output.copy_(out.view(output.shape))


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op: str, group: Group,
                          native: bool) -> None:
    """Reduce ``input`` across ranks and keep this rank's dim-0 piece in ``output``."""
    name, divide = _op(op, native)
    out = funcol.reduce_scatter_tensor(input.contiguous(), name, 0, _group(group))
    if divide:
        out = out / dist.get_world_size(group)
    output.copy_(out.view(output.shape))


def all_to_all_single(output: torch.Tensor, input: torch.Tensor,
                      output_split_sizes: Sequence[int] | None,
                      input_split_sizes: Sequence[int] | None, group: Group) -> None:
    """All-to-all of dim-0 pieces into ``output``, traceable."""
    out = funcol.all_to_all_single(
        input.contiguous(),
        list(output_split_sizes) if output_split_sizes is not None else None,
        list(input_split_sizes) if input_split_sizes is not None else None,
        _group(group))
    output.copy_(out.view(output.shape))


def broadcast(tensor: torch.Tensor, src: int, group: Group) -> None:
    """In-place broadcast from global rank ``src``, traceable."""
    # The functional op takes the root's rank within the group.
    root = src if group is None else dist.get_group_rank(group, src)
    tensor.copy_(funcol.broadcast(tensor, root, _group(group)))
