"""Catch shards whose sizes the ranks disagree on before a gather aborts the process.

``DTensor.from_local(local, mesh, [Shard(d)], run_check=False)`` without ``shape=`` infers the
global shape from *this* rank's piece, assuming even shards (torch's rule, no communication).
When the pieces are in fact uneven every rank infers a different global shape; the first
all-gather then gets different sizes on each rank, and gloo aborts one process (SIGABRT, no
Python error) while another returns a tensor of the wrong shape.

Such a DTensor's local tensor is recorded here (:func:`note_inferred`). The first time a
redistribution gathers it -- all ranks are entering a collective then anyway -- one small
all-gather of the piece sizes runs first (:func:`verify_before_gather`); uneven pieces raise
:class:`UnevenShardsError` on every rank of the mesh, naming each rank's size. Nothing is
recorded (and nothing runs) for DTensors whose global shape was given or checked.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from hyperpar.dtensor.api_core import inferred_uneven_message, uneven_lengths
from hyperpar.dtensor.placement import Shard
from hyperpar.platform import get_platform

# id(local tensor) -> (mesh, placements, what made it); entries leave with their tensor.
_INFERRED: dict[int, tuple[Any, tuple, str]] = {}


class UnevenShardsError(ValueError):
    """Ranks hold pieces of different sizes for a DTensor whose global shape assumed even
    shards."""


_FROM_LOCAL_FIX = ("Pass the global shape= (and stride=) to DTensor.from_local for uneven "
                  "shards (torch.chunk's layout: the first ranks hold the larger pieces), or "
                  "run_check=True to have it checked")


def note_inferred(local: torch.Tensor, mesh: Any, placements: tuple, source: str,
                  fix: str = _FROM_LOCAL_FIX) -> None:
    """Record that ``local``'s global shape was inferred assuming even shards (``source``
    made it; ``fix`` says what to do instead)."""
    if not any(type(p) is Shard and mesh.shape[m] > 1 for m, p in enumerate(placements)):
        return
    key = id(local)
    _INFERRED[key] = (mesh, tuple(placements), f"{source}\x00{fix}")
    weakref.finalize(local, _INFERRED.pop, key, None)


def verify_before_gather(local: torch.Tensor) -> None:
    """If ``local`` is recorded, check (once) on every rank that its pieces are even."""
    if torch.compiler.is_compiling():  # a graph cannot read sizes out of a collective
        return
    entry = _INFERRED.pop(id(local), None)
    if entry is None:
        return
    mesh, placements, text = entry
    source, fix = text.split("\x00", 1)
    platform = get_platform()
    found = []
    for m, p in enumerate(placements):
        if type(p) is not Shard or mesh.shape[m] == 1:
            continue
        group = mesh.get_group(m)
        n = mesh.shape[m]
        mine = torch.tensor([local.shape[p.dim]], dtype=torch.int64, device=local.device)
        sizes = torch.empty(n, dtype=torch.int64, device=local.device)
        platform.all_gather_into_tensor(sizes, mine, group)
        ranks = mesh.group_ranks(m) if hasattr(mesh, "group_ranks") else list(range(n))
        text = uneven_lengths(p, m, ranks, sizes.tolist())
        if text:
            found.append(text)
    # every rank of the mesh learns whether any group disagreed (max over each dim in turn)
    flag = torch.tensor([1 if found else 0], dtype=torch.int64, device=local.device)
    for m in range(mesh.ndim):
        if mesh.shape[m] > 1:
            platform.all_reduce(flag, "max", mesh.get_group(m))
    if int(flag.item()):
        raise UnevenShardsError(inferred_uneven_message(source, found, fix))
