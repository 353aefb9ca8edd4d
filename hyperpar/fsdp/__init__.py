"""Sharded data parallelism (ZeRO-3 / torch FSDP2 semantics) written above the Platform.

``fully_shard`` shards each parameter on dim 0 over the data-parallel mesh; see
``docs/fsdp.md``.
"""

from .api import FSDPModule, UnshardHandle, fully_shard, register_fsdp_forward_method
from .clip import clip_grad_norm_
from .policy import CPUOffloadPolicy, DataParallelMeshDims, MixedPrecisionPolicy, OffloadPolicy

__all__ = ["CPUOffloadPolicy", "DataParallelMeshDims", "FSDPModule", "MixedPrecisionPolicy",
           "OffloadPolicy", "UnshardHandle", "clip_grad_norm_", "fully_shard",
           "register_fsdp_forward_method"]
