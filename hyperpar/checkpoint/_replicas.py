"""Replica agreement: a save refuses a box of a tensor that several ranks hold with different
bytes. The writer keeps one copy of each box (the lowest rank's, :func:`._commit.owners`), so
replicas that differ -- data-parallel replicas that diverged, a tensor-parallel ``Replicate``
bias changed on one rank, or a parameter split by hand (not by ``parallelize_module``) that
looks whole -- would otherwise be saved silently as one of them.

The numpy save path (:mod:`.arrays`, which the MindSpore backend uses) calls
:func:`check_replicas_agree` with the box metadata it gathered. The PyTorch writer does not
(yet): there every box of a data-parallel model is shared, so the hashing (~2 s per GB of
parameters on one CPU core) would land on every save of every DDP/HSDP job, and GPU kernels
that are not bitwise deterministic may leave replicas a few ulps apart -- see
docs/checkpoint.md. No framework here.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from typing import Any

from hyperpar.platform import get_platform

from ._commit import Box
from ._format import CheckpointError

__all__ = ["check_replicas_agree"]


def shared_boxes(metas: list[list[dict[str, Any]]]) -> set[Box]:
    """The boxes more than one rank holds (every rank's box metadata, as gathered)."""
    holders: dict[Box, int] = {}
    for items in metas:
        for m in items:
            box = (m["key"], tuple(m["offset"]), tuple(m["local_shape"]))
            holders[box] = holders.get(box, 0) + 1
    return {box for box, n in holders.items() if n > 1}


def check_replicas_agree(metas: list[list[dict[str, Any]]],
                         buffers: Mapping[Box, Callable[[], Any]]) -> None:
    """Raise :class:`CheckpointError` on every rank when ranks holding the same box hold
    different bytes. ``metas``: every rank's box metadata (the same list on every rank);
    ``buffers``: this rank's boxes -> a function returning the box's bytes (any C-contiguous
    buffer: a numpy array, a memoryview). Only boxes another rank also holds are hashed
    (blake2b), so a fully sharded model costs nothing; otherwise one small all-gather of
    16-byte digests. Collective when any box is shared (every rank decides alike from
    ``metas``)."""
    shared = shared_boxes(metas)
    if not shared:
        return
    mine = {box: hashlib.blake2b(get(), digest_size=16).digest()
            for box, get in buffers.items() if box in shared}
    seen: dict[Box, dict[bytes, list[int]]] = {}
    for rank, claims in enumerate(get_platform().all_gather_object(mine)):
        for box, digest in claims.items():
            seen.setdefault(box, {}).setdefault(digest, []).append(rank)
    differ = sorted((box[0], sorted(by.values())) for box, by in seen.items() if len(by) > 1)
    if not differ:
        return
    shown = "; ".join(f"{key!r} (ranks {' vs '.join(','.join(map(str, g)) for g in groups)})"
                      for key, groups in differ[:4])
    raise CheckpointError(
        f"checkpoint.save: ranks that hold the same box of a tensor hold different values: "
        f"{shown}{' ...' if len(differ) > 4 else ''}. Replicas must agree (were gradients "
        "averaged over every replica?); a parameter split by hand must be split with "
        "parallelize_module so its layout is known. Nothing was written")
