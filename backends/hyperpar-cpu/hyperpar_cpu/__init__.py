"""hyperpar backend for CPUs: tensors on ``cpu``, collectives through gloo."""

from .platform import CPUPlatform

__all__ = ["CPUPlatform"]
