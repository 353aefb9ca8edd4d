"""Sharded checkpoints of parallelised models: ``save`` / ``load`` (resharding to the current
layout) and ``full_state_dict`` (plain tensors on rank 0). See :mod:`.sharded`."""

from .sharded import INDEX_FILE, full_state_dict, load, read_index, save

__all__ = ["INDEX_FILE", "full_state_dict", "load", "read_index", "save"]
