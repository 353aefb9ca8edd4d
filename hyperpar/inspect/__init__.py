"""Capture and edit full activations of a sharded model by module name (FlexModel-like), on
every backend. See :mod:`.model`."""

from .model import HookFunction, InspectedModel, ShapeMismatchError

__all__ = ["HookFunction", "InspectedModel", "ShapeMismatchError"]
