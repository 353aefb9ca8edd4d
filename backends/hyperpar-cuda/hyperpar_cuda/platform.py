"""CUDAPlatform: tensors on ``cuda`` devices, collectives through NCCL."""

from __future__ import annotations

import torch

from hyperpar.platform import Availability
from hyperpar.platform.torch_platform import TorchPlatform, accelerator_availability


class CUDAPlatform(TorchPlatform):
    """NVIDIA GPUs (also AMD GPUs through ROCm builds of torch, which expose ``torch.cuda``)."""

    name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"
    priority = 100
    visible_devices_env = "CUDA_VISIBLE_DEVICES"

    @classmethod
    def is_available(cls) -> Availability:
        if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
            return Availability(
                False,
                f"this torch build ({torch.__version__}) has no CUDA support; install a CUDA "
                "build of torch",
            )
        return accelerator_availability(cls, torch.cuda)
