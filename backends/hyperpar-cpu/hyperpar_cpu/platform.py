"""CPUPlatform: every process computes on the host CPU and talks over gloo."""

from __future__ import annotations

from hyperpar.platform import Availability
from hyperpar.platform.torch_platform import HostDevicePlatform


class CPUPlatform(HostDevicePlatform):
    """The always-available backend (lowest priority in auto-detection)."""

    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    priority = 0
    visible_devices_env = None
    # gloo has no AVG reduction: the platform emulates it as SUM then divide.
    native_reduce_ops = ("sum", "max", "min", "product")

    @classmethod
    def is_available(cls) -> Availability:
        return Availability(True)
