"""The names and errors of the checkpoint format that both :mod:`._format` (reading and
writing the index) and :mod:`._validate` (checking an untrusted index) need: a module of its own
so that neither imports the other. No framework."""

from __future__ import annotations

__all__ = ["INDEX_FILE", "VERSION", "CheckpointError", "CorruptCheckpointError"]

INDEX_FILE = "index.json"
#: 1: files overwritten in place, no digests. 2: per-save file names, sha256 per chunk, sizes.
VERSION = 2


class CheckpointError(ValueError):
    """A checkpoint cannot be loaded into this model as asked (keys, shapes, files)."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint file is missing, truncated, unreadable, or its bytes fail their digest."""
