"""Checks of what a parallel style is fed, and the note for an inferred sequence length.

Under ``HYPERPAR_DEBUG_COLLECTIVES=1`` (read when the plan is applied; nothing is installed
otherwise) every module a plan parallelizes gets a forward pre-hook, run before the style's
own, that checks its plain-tensor inputs across the ranks of the mesh with one small
all-gather per input (a checksum, never the data):

* a ``Replicate()`` input must be the same tensor on every rank -- a tensor-parallel model
  fed a different batch per rank computes garbage without any error;
* a ``Shard(d)`` input must hold ``torch.chunk``'s pieces of one tensor: the other dims
  equal, the lengths along ``d`` those of an even split (the first ranks one longer), and the
  pieces not all identical (every rank passing the *full* sequence to ``SequenceParallel``
  instead of its shard doubles the sequence).

A failed check raises :class:`InputLayoutError` on every rank, naming the module, the input,
and the ranks that differ. Under the same flag, the output of ``SequenceParallel`` on a plain
input (whose global length assumes an even split) is checked at its first gather: an odd
sequence length raises ``UnevenShardsError`` there instead of a gloo abort.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from hyperpar.dtensor import _shape_check
from hyperpar.dtensor.layout import input_layout_problem
from hyperpar.platform import get_platform
from hyperpar.platform.health import DEBUG_ENV
from hyperpar.platform.health import debug_enabled as health_debug_enabled

_TRUE = ("1", "true", "yes", "on")
_MAX_DIMS = 8


class InputLayoutError(ValueError):
    """A parallelized module's input does not have the layout its style promises."""


def debug_checks_enabled() -> bool:
    return os.environ.get(DEBUG_ENV, "").strip().lower() in _TRUE


def note_inferred_output(out: Any, mesh: Any, placement: Any, module: nn.Module) -> None:
    """``out`` (a DTensor) got its global length from an even-split assumption on plain
    sequence shards: under the debug flag, have its first gather check that the pieces really
    are even. (Not by default: it would cost two small collectives per norm per step, which is
    what assuming an even split, as torch does, avoids.)"""
    if not health_debug_enabled():
        return
    local = getattr(out, "_local", None)
    if local is not None:
        _shape_check.note_inferred(local, mesh, (placement,),
                      f"SequenceParallel on {type(module).__name__} (a plain sequence-sharded "
                      f"input is taken to be split evenly; an odd sequence length is not)",
                      f"Pass the input as a DTensor that knows its global length "
                      f"(DTensor.from_local(x, mesh, [{placement}], shape=...)), or use a "
                      f"sequence length divisible by the mesh size ({mesh.size(0)})")


def verify_dtensor_input(local: torch.Tensor) -> None:
    """A style's DTensor input whose global length was inferred: check it before the
    boundary gathers it (the gather would abort on uneven pieces)."""
    # not when compiled: reading the record table would make Dynamo guard on its contents
    # (one recompile per new input); a graph cannot run the size check anyway
    if not torch.compiler.is_compiling() and _shape_check._INFERRED:
        _shape_check.verify_before_gather(local)


def _expected_layouts(style: Any) -> tuple[Any, ...] | None:
    if hasattr(style, "sequence_sharding"):
        return tuple(style.sequence_sharding)
    layouts = getattr(style, "input_layouts", None)
    return tuple(layouts) if layouts else None


def install_input_checks(style: Any, module: nn.Module, mesh: Any, fqn: str) -> None:
    """Under the debug flag, check ``module``'s inputs against ``style``'s input layouts
    (registered before the style's own hooks, so the check sees what the caller passed)."""
    if not debug_checks_enabled():
        return
    layouts = _expected_layouts(style)
    if not layouts or getattr(mesh, "ndim", 1) != 1 or mesh.size(0) == 1:
        return
    where = f"{fqn or '<root>'!r} ({type(style).__name__})"

    def check(mod: nn.Module, args: tuple, kwargs: dict) -> None:
        for i, (x, layout) in enumerate(zip(args, layouts, strict=False)):
            if type(x) is torch.Tensor and layout is not None:  # DTensors carry their layout
                check_input(x, layout, mesh, f"{where}, input {i}")
        return None

    get_platform().register_forward_pre_hook(module, check, with_kwargs=True)


def _summary(x: torch.Tensor) -> torch.Tensor:
    """``[ndim, *shape (padded), sum, position-weighted sum]`` in float64."""
    if x.dim() > _MAX_DIMS:
        raise InputLayoutError(f"debug input check: {x.dim()}-D inputs are not supported")
    flat = x.detach().reshape(-1).to(torch.float64)
    weights = torch.arange(flat.numel(), dtype=torch.float64, device=flat.device) % 997 + 1
    shape = list(x.shape) + [0] * (_MAX_DIMS - x.dim())
    head = torch.tensor([x.dim(), *shape], dtype=torch.float64, device=flat.device)
    return torch.cat([head, torch.stack([flat.sum(), (flat * weights).sum()])])


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a[:1 + _MAX_DIMS], b[:1 + _MAX_DIMS])) and bool(
        torch.allclose(a[1 + _MAX_DIMS:], b[1 + _MAX_DIMS:], rtol=1e-9, atol=0.0))


def _shape_of(row: torch.Tensor) -> tuple[int, ...]:
    nd = int(row[0])
    return tuple(int(v) for v in row[1:1 + nd])


def check_input(x: torch.Tensor, layout: Any, mesh: Any, where: str) -> None:
    """Check one plain-tensor input laid out as ``layout`` over the 1-D ``mesh`` (a
    collective: every rank of the mesh calls it); raise on every rank if it is not."""
    platform = get_platform()
    n = mesh.size(0)
    mine = _summary(x)
    rows = torch.empty(n * mine.numel(), dtype=mine.dtype, device=mine.device)
    platform.all_gather_into_tensor(rows, mine, mesh.get_group(0))
    rows = rows.view(n, -1)
    ranks = list(mesh.group_ranks(0)) if hasattr(mesh, "group_ranks") else list(range(n))
    differ = [ranks[k] for k in range(1, n) if not _same(rows[0], rows[k])]
    problem = input_layout_problem(layout, [_shape_of(r) for r in rows], ranks, differ,
                                   _varies(x), where)
    if problem:
        raise InputLayoutError(problem)


def _varies(x: torch.Tensor) -> bool:
    """More than one distinct value (identical constant pieces are legitimate)."""
    flat = x.detach().reshape(-1)
    return flat.numel() > 1 and not bool((flat == flat[0]).all())
