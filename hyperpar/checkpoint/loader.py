"""``load``: each rank reads the parts of the saved chunks that overlap what it holds now.

Steps: check the index and every file it names (paths confined to the folder, regular files,
schema, sizes, safetensors headers against the index; see :mod:`._validate`), then the model
against the index on every rank together (keys, shapes), read and
verify the boxes, then agree that every rank succeeded, so a problem seen by one rank is raised
on all of them instead of leaving the others waiting.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from hyperpar.platform import get_platform

from ._boxes import copy_box, local_box
from ._commit import agree_or_raise, check_keys, show_keys
from ._format import LoadResult, read_index
from ._read import Reader, assemble
from ._validate import check_files
from .optim import check_optimizer, load_optimizer, optimizer_keys

__all__ = ["agree_or_raise", "load", "show_keys", "verify"]


def load(model: nn.Module, path: str | os.PathLike, *,
         optimizer: torch.optim.Optimizer | None = None, strict: bool = True,
         verify: bool = True) -> LoadResult:
    """Load checkpoint folder ``path`` into ``model``, resharding to its current layout.

    Each rank reads only the saved chunks overlapping what it holds, and checks every chunk it
    reads against the digest in the index (a corrupted or truncated file raises
    :class:`CorruptCheckpointError` naming the file, on every rank); a chunk is read whole
    to be checked, so ``verify=False`` (sizes still checked) reads only the overlapping slices
    where a rank needs a small part of a large chunk. ``strict`` is
    ``torch.nn.Module.load_state_dict``'s: model tensors missing from the checkpoint *and*
    checkpoint tensors the model lacks (over all ranks together, so pipeline stages count as
    one model) raise :class:`CheckpointError`, before anything is copied. A global shape that
    differs always raises. With ``optimizer`` (built over the model's current parameters), its
    state is restored and resharded the same way. Returns ``LoadResult(missing_keys,
    unexpected_keys)``. Collective. After a raise the model may be partly loaded.

    The checkpoint is treated as untrusted: before any tensor data is read, the index's schema,
    every file it names (inside ``path``, a regular file, its recorded size, its safetensors
    header against the index's dtypes and shapes) and, with ``optimizer``, the saved optimizer
    type are checked; a problem raises :class:`CheckpointError` on every rank (docs:
    "Trust model").
    """
    path = os.fspath(path)
    # A checkpoint is untrusted: every rank checks the index, the ranks share the checks of
    # the files it names, all before reading tensor data; all ranks share the outcome (no rank
    # reads on, none waits).
    error: Exception | None = None
    try:
        index = read_index(path)
        platform = get_platform()
        check_files(path, index, part=(platform.rank(), platform.world_size()))
        if optimizer is not None:
            check_optimizer(optimizer, index, path)
    except Exception as exc:  # shared below: a rank that failed alone must not leave the
        error = exc           # others waiting in the next collective
    agree_or_raise(error)
    state = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    result = _check_keys(state, index, path, strict)
    reader = Reader(path, index, verify=verify)
    try:
        with torch.no_grad():
            _copy_in(state, index["tensors"], reader)
        if optimizer is not None:
            load_optimizer(model, optimizer, index, reader, path)
    except Exception as exc:  # shared below, so no rank waits for one that failed
        error = exc
    agree_or_raise(error)
    return result


def _check_keys(state: dict[str, torch.Tensor], index: dict[str, Any], path: str,
                strict: bool) -> LoadResult:
    """Missing/unexpected keys and shape mismatches over all ranks; raises on every rank."""
    model_only = set(index["tensors"]) - optimizer_keys(index)
    missing, unexpected = check_keys({k: v.shape for k, v in state.items()}, index, path,
                                     strict, model_only)
    return LoadResult(missing, unexpected)


def _copy_in(state: dict[str, torch.Tensor], saved: dict[str, Any], reader: Reader) -> None:
    """Copy this rank's box of every model tensor found in the checkpoint."""
    for key, value in state.items():
        entry = saved.get(key)
        if entry is None:
            continue
        offset, shape, _ = local_box(value)
        copy_box(value, assemble(entry, key, list(offset), list(shape), reader))


def verify(path: str | os.PathLike) -> int:
    """Check every file and chunk of checkpoint ``path`` against its index (sizes and sha256
    digests); return the number of chunks checked. Not collective: run it on one process."""
    path = os.fspath(path)
    index = read_index(path)
    check_files(path, index)
    reader = Reader(path, index)
    n = 0
    for key, entry in index["tensors"].items():
        for chunk in entry["chunks"]:
            reader.read(chunk, (), key=key)
            n += 1
    return n
