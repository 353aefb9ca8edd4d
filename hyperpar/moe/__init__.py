"""Mixture-of-Experts: the framework-neutral core (this package's ``placement``, ``routing``
and ``errors`` modules import no framework) and, where torch is installed, its mechanics.

Core API (ints and lists; both frameworks' mechanics call it):

* :class:`~hyperpar.moe.placement.ExpertPlacement` -- which ep rank owns which experts;
  :func:`~hyperpar.moe.placement.check_moe_config`, ``expert_capacity``, ``sparse_layout``
  (torchtitan's ``(pp, dp_replicate, efsdp, ep)`` groups), ``expert_weight_placements``.
* :func:`~hyperpar.moe.routing.dispatch_plan` -- split sizes and segment orders of one rank's
  dispatch and combine; ``capacity_keep`` (the stated drop order), ``stable_sort_by_expert``,
  ``reference_count_exchange``.
* :class:`~hyperpar.moe.errors.MoEConfigError`, :class:`~hyperpar.moe.errors.MoERoutingError`.

The expert-parallel styles (``ExpertParallel``, ``ExpertTensorParallel``, ``TensorParallel``
for grouped experts) live in :mod:`hyperpar.torch.moe.styles`, exported from ``hyperpar`` and
``hyperpar.parallel``.

The torch layer for models written by hand (loaded lazily on first use, so this package imports
without torch): :class:`MoE`, :class:`GroupedExperts`, :class:`FeedForward`,
:class:`TokenChoiceTopKRouter`, :func:`load_balancing_loss`, :func:`update_expert_bias`
(:mod:`hyperpar.torch.moe`). DeepSpeed's layer: ``from hyperpar.moe.deepspeed import MoE``.
"""

from typing import Any

# This package is in tests/test_layering.py's NEUTRAL_MODULES: anything torch-specific added here
# must load behind a try/except ImportError on torch, as hyperpar/parallel/__init__.py does.
from .errors import MoEConfigError, MoERoutingError
from .placement import (
    ExpertPlacement,
    SparseLayout,
    check_moe_config,
    expert_capacity,
    expert_weight_placements,
    sparse_layout,
)
from .routing import DispatchPlan, capacity_keep, dispatch_plan

_TORCH_LAYER = {
    "MoE": "layer", "GroupedExperts": "experts", "FeedForward": "experts",
    "grouped_mm_available": "experts", "TokenChoiceTopKRouter": "router",
    "RouterNaNError": "router", "load_balancing_loss": "router",
    "update_expert_bias": "router",
}

__all__ = [
    "DispatchPlan",
    "ExpertPlacement",
    "MoEConfigError",
    "MoERoutingError",
    "SparseLayout",
    "capacity_keep",
    "check_moe_config",
    "dispatch_plan",
    "expert_capacity",
    "expert_weight_placements",
    "sparse_layout",
]

__all__ += sorted(_TORCH_LAYER)


def __getattr__(name: str) -> Any:
    # The torch layer loads on first use: the neutral core must import without torch.
    if name in _TORCH_LAYER:
        import importlib

        module = importlib.import_module(f"hyperpar.torch.moe.{_TORCH_LAYER[name]}")
        return getattr(module, name)
    raise AttributeError(f"module 'hyperpar.moe' has no attribute {name!r}")
