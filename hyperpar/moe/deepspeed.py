"""DeepSpeed's MoE layer: ``from deepspeed.moe.layer import MoE`` becomes
``from hyperpar.moe.deepspeed import MoE`` (torch only; see :mod:`hyperpar.torch.moe.deepspeed`).
"""

from hyperpar.torch.moe.deepspeed import (  # noqa: F401
    Experts,
    MoE,
    MOELayer,
    TopKGate,
    allreduce_gradients,
    expert_parallel_ranks,
    is_moe_param,
    split_params_into_different_moe_groups_for_optimizer,
    top1gating,
    top2gating,
    topkgating,
)

__all__ = ["Experts", "MOELayer", "MoE", "TopKGate", "allreduce_gradients",
           "expert_parallel_ranks", "is_moe_param",
           "split_params_into_different_moe_groups_for_optimizer", "top1gating", "top2gating",
           "topkgating"]
