"""NPUPlatform: Ascend NPUs through torch_npu (device ``npu``, collectives through HCCL)."""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

from hyperpar.platform import Availability
from hyperpar.platform.torch_platform import TorchPlatform, accelerator_availability


def _import_torch_npu() -> tuple[ModuleType | None, str | None]:
    """Import torch_npu (which registers ``torch.npu``); return the module or why it failed."""
    try:
        importlib.import_module("torch_npu")
    except Exception as exc:  # ImportError, or OSError for missing CANN libraries
        return None, (
            f"torch_npu import failed: {type(exc).__name__}: {exc}. Install Ascend CANN and "
            "`pip install hyperpar-npu[torch_npu]` (torch_npu pins its matching torch)"
        )
    return getattr(torch, "npu", None), None


class NPUPlatform(TorchPlatform):
    """Ascend NPUs. ``torch_npu`` is imported lazily, only when this backend is probed."""

    name = "npu"
    device_type = "npu"
    dist_backend = "hccl"
    priority = 90
    visible_devices_env = "ASCEND_RT_VISIBLE_DEVICES"
    # Reduce ops HCCL is relied on for; "avg" goes through the platform's sum-then-divide
    # fallback, which is correct everywhere and costs one local division.
    native_reduce_ops = ("sum", "max", "min", "product")

    @classmethod
    def is_available(cls) -> Availability:
        module, error = _import_torch_npu()
        return accelerator_availability(cls, module, error)

    def device_module(self) -> ModuleType:
        module, error = _import_torch_npu()
        if module is None:
            raise RuntimeError(error)
        return module
