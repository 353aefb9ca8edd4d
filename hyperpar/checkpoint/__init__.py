"""Sharded, crash-safe checkpoints of parallelised models.

* ``save`` / ``load`` -- a checkpoint folder written by every rank, loaded into any layout
  (:mod:`.writer`, :mod:`.loader`; format in :mod:`._format`).
* ``full_state_dict`` -- plain tensors on rank 0 (:mod:`.gather`).
* ``load_safetensors`` -- a full safetensors / Hugging Face checkpoint into a sharded model,
  each rank reading only its slices (:mod:`.hf`).
* ``verify`` -- check a checkpoint's files against the digests in its index.
"""

from ._format import INDEX_FILE, CheckpointError, CorruptCheckpointError, LoadResult, read_index
from ._lock import ConcurrentSaveError
from .gather import full_state_dict
from .hf import load_safetensors
from .loader import load, verify
from .writer import save

__all__ = ["INDEX_FILE", "CheckpointError", "ConcurrentSaveError", "CorruptCheckpointError",
           "LoadResult",
           "full_state_dict", "load", "load_safetensors", "read_index", "save", "verify"]
