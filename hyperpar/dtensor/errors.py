"""Errors shared by every framework's parallel transforms (this module imports no framework)."""

from __future__ import annotations

__all__ = ["AlreadyParallelizedError"]


class AlreadyParallelizedError(RuntimeError):
    """A style (or ``distribute_module``) was applied to a module that is already parallelized
    in the same respect; applying it again would run its boundary hooks twice."""
