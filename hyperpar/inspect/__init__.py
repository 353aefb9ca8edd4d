"""Capture and edit full activations of a sharded model by module name, on every backend:
:class:`InspectedModel` (see :mod:`.model`) and FlexModel's API over it (:class:`FlexModel`,
see :mod:`.flex`)."""

from .flex import FlexModel
from .model import HookFunction, InspectedModel, ShapeMismatchError

__all__ = ["FlexModel", "HookFunction", "InspectedModel", "ShapeMismatchError"]
