"""hyperpar backend for NVIDIA GPUs: tensors on ``cuda``, collectives through NCCL."""

from .platform import CUDAPlatform

__all__ = ["CUDAPlatform"]
