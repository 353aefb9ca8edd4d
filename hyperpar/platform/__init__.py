"""The platform layer: the Platform contract, TorchPlatform and the backend registry."""

from .base import (
    REDUCE_OPS,
    Availability,
    DeviceCapacityError,
    P2POp,
    Platform,
    abstract_members,
)
from .hookspecs import ENTRY_POINT_GROUP, hookimpl
from .registry import (
    BackendError,
    BackendInfo,
    backends,
    get_platform,
    register_plugin,
    reset,
    selection_rule,
    set_backend,
    unregister_plugin,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "REDUCE_OPS",
    "Availability",
    "BackendError",
    "BackendInfo",
    "DeviceCapacityError",
    "P2POp",
    "Platform",
    "abstract_members",
    "backends",
    "get_platform",
    "hookimpl",
    "register_plugin",
    "reset",
    "selection_rule",
    "set_backend",
    "unregister_plugin",
]
