"""CPUPlatform: every process computes on the host CPU and talks over gloo."""

from __future__ import annotations

import resource

import torch

from hyperpar.platform import Availability
from hyperpar.platform.torch import TorchPlatform


class CPUPlatform(TorchPlatform):
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

    def device_count(self) -> int:
        return 1

    def device(self, index: int | None = None) -> torch.device:
        return torch.device("cpu")

    def set_device(self, index: int) -> None:
        """CPU processes share the host; there is no device to select."""

    def current_device(self) -> int:
        return 0

    def synchronize(self) -> None:
        """CPU kernels run synchronously."""

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def get_rng_state(self) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        torch.set_rng_state(state)

    def memory_stats(self) -> dict[str, int]:
        # Peak resident set size of the process (Linux reports KiB): the closest CPU analogue.
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return {"allocated": 0, "max_allocated": int(peak)}
