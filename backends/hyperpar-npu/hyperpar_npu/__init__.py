"""hyperpar backend for Ascend NPUs: tensors on ``npu``, collectives through HCCL."""

from .platform import NPUPlatform

__all__ = ["NPUPlatform"]
