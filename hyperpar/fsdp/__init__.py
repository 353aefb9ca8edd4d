"""Sharded data parallelism (ZeRO-3 / torch FSDP2 semantics) written above the Platform.

``fully_shard`` shards each parameter on dim 0 over the data-parallel mesh; see
``docs/fsdp.md``.

Where torch is not installed (a MindSpore venv), ``from hyperpar.fsdp import fully_shard`` (the
line a torch FSDP2 script gets after its import is rewritten) gives the platform's
implementation, MindSpore's :func:`hyperpar_mindspore.fully_shard`, as ``hyperpar.fully_shard``
does. In a venv with both frameworks use ``from hyperpar import fully_shard`` (it follows
``HYPERPAR_BACKEND``) or import from ``hyperpar_mindspore``.
"""

from typing import Any as _Any

from hyperpar.platform.registry import torch_installed as _torch_installed

__all__ = ["CPUOffloadPolicy", "DataParallelMeshDims", "FSDPMeshInfo", "FSDPModule",
           "MixedPrecisionPolicy", "OffloadPolicy", "ShardPlacementResult", "UnshardHandle",
           "clip_grad_norm_", "fully_shard", "register_fsdp_forward_method"]


if _torch_installed():
    from .api import FSDPModule, UnshardHandle, fully_shard, register_fsdp_forward_method
    from .clip import clip_grad_norm_
    from .policy import (
        CPUOffloadPolicy,
        DataParallelMeshDims,
        FSDPMeshInfo,
        MixedPrecisionPolicy,
        OffloadPolicy,
        ShardPlacementResult,
    )
else:   # no torch: the policies (framework-free) here, the rest the platform's (MindSpore's)
    from .policy import (
        CPUOffloadPolicy,
        DataParallelMeshDims,
        FSDPMeshInfo,
        MixedPrecisionPolicy,
        OffloadPolicy,
        ShardPlacementResult,
    )

    def __getattr__(name: str) -> _Any:
        from hyperpar.platform import get_platform  # the backend is never named here

        api = get_platform().parallel_api()
        value = getattr(api, name, None) if api is not None else None
        if value is None:
            have = sorted(n for n in __all__ if api is not None and hasattr(api, n))
            raise AttributeError(
                f"hyperpar.fsdp.{name} is not available without torch: the "
                f"{get_platform().name!r} backend offers {have} here "
                f"(see docs/mindspore.md, 'fully_shard on Cells')")
        globals()[name] = value
        return value
