"""The MoE core's error types: bad configuration and bad routing input, each a ``ValueError``
so callers that catch torch's ``ValueError`` for bad arguments keep working."""

from __future__ import annotations


class MoEConfigError(ValueError):
    """An expert-parallel configuration that cannot work: experts not divisible by the EP
    degree, ``k`` above the expert count, a mesh without the named dim, a degree that does not
    divide the world, a capacity factor <= 0. Raised before any collective."""


class MoERoutingError(ValueError):
    """Routing input that would give a wrong or hung dispatch: counts that do not add up to the
    tokens given, negative counts, expert ids out of range, NaN router scores, expert counts or
    hidden sizes that differ across ranks."""
