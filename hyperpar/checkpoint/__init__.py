"""Sharded, crash-safe checkpoints of parallelised models.

* ``async_save`` -- ``save`` that returns a future once the tensors are staged in host memory;
  the write and the atomic commit run in a background thread (:mod:`._async`).
* ``save`` / ``load`` -- a checkpoint folder written by every rank, loaded into any layout
  (:mod:`.writer`, :mod:`.loader`; format in :mod:`._format`). A MindSpore ``Cell`` is saved
  and loaded by its backend (``hyperpar_mindspore.checkpoint``, over :mod:`.arrays`) in the
  same format, so either framework loads the other's folders (``name_map=``).
* ``full_state_dict`` -- plain tensors on rank 0 (:mod:`.gather`).
* ``load_safetensors`` -- a full safetensors / Hugging Face checkpoint into a sharded model,
  each rank reading only its slices (:mod:`.hf`).
* ``verify`` -- check a checkpoint's files against the digests in its index.

Importing this package imports no framework: the PyTorch half loads on first use.
"""

from __future__ import annotations

import importlib
import os
import sys
from concurrent.futures import Future
from typing import Any

from ._format import INDEX_FILE, CheckpointError, CorruptCheckpointError, LoadResult, read_index
from ._lock import ConcurrentSaveError

__all__ = ["INDEX_FILE", "CheckpointError", "ConcurrentSaveError", "CorruptCheckpointError",
           "LoadResult", "async_save", "full_state_dict", "load", "load_safetensors",
           "read_index", "save", "verify"]

_TORCH_ONLY = {"full_state_dict": ".gather", "load_safetensors": ".hf", "verify": ".loader"}


def _framework_impl(model: Any) -> Any:
    """The platform's checkpoint module for ``model`` when it is not a torch module or a
    state dict (a MindSpore Cell), else None (hyperpar's PyTorch writer and loader)."""
    if isinstance(model, dict):
        return None
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(model, torch.nn.Module):
        return None
    from hyperpar.platform import get_platform

    api = get_platform().parallel_api()
    if api is None:
        return None
    return importlib.import_module(f"{api.__name__}.checkpoint")


def save(model: Any, path: str | os.PathLike, **kwargs: Any) -> str:
    """Save ``model`` (a torch module or state dict, or a MindSpore Cell) as checkpoint folder
    ``path``; see :func:`hyperpar.checkpoint.writer.save` (torch) and
    ``hyperpar_mindspore.checkpoint.save`` (``name_map=``). Collective."""
    impl = _framework_impl(model)
    if impl is not None:
        return impl.save(model, path, **kwargs)
    from .writer import save as torch_save

    return torch_save(model, path, **kwargs)


def async_save(model: Any, path: str | os.PathLike, **kwargs: Any) -> Future[str]:
    """Like :func:`save`, but returns once the tensors are staged in host memory; the write
    and the commit run in a background thread. The future's ``result()`` is the index path
    once committed; a later save waits for it. See
    :func:`hyperpar.checkpoint.writer.async_save` (torch) and
    ``hyperpar_mindspore.checkpoint.async_save``. Collective."""
    impl = _framework_impl(model)
    if impl is not None:
        return impl.async_save(model, path, **kwargs)
    from .writer import async_save as torch_async_save

    return torch_async_save(model, path, **kwargs)


def load(model: Any, path: str | os.PathLike, **kwargs: Any) -> LoadResult:
    """Load checkpoint folder ``path`` into ``model``, resharding to its layout; see
    :func:`hyperpar.checkpoint.loader.load` (torch) and ``hyperpar_mindspore.checkpoint.load``
    (``name_map=``). Collective."""
    impl = _framework_impl(model)
    if impl is not None:
        return impl.load(model, path, **kwargs)
    from .loader import load as torch_load

    return torch_load(model, path, **kwargs)


def __getattr__(name: str) -> Any:
    module = _TORCH_ONLY.get(name)
    if module is None:
        raise AttributeError(f"module 'hyperpar.checkpoint' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value
