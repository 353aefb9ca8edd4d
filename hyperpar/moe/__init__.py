"""Mixture-of-Experts.

The torch layer for models written by hand (imported lazily, so this package stays importable
without torch): :class:`MoE`, :class:`GroupedExperts`, :class:`FeedForward`,
:class:`TokenChoiceTopKRouter`, :func:`load_balancing_loss`, :func:`update_expert_bias`
(:mod:`hyperpar.torch.moe`). DeepSpeed's layer: ``from hyperpar.moe.deepspeed import MoE``.
"""

from __future__ import annotations

from typing import Any

_TORCH_LAYER = {
    "MoE": "layer", "GroupedExperts": "experts", "FeedForward": "experts",
    "grouped_mm_available": "experts", "TokenChoiceTopKRouter": "router",
    "RouterNaNError": "router", "load_balancing_loss": "router",
    "update_expert_bias": "router",
}

__all__ = sorted(_TORCH_LAYER)


def __getattr__(name: str) -> Any:
    # The torch layer loads on first use: the neutral core must import without torch.
    if name in _TORCH_LAYER:
        import importlib

        module = importlib.import_module(f"hyperpar.torch.moe.{_TORCH_LAYER[name]}")
        return getattr(module, name)
    raise AttributeError(f"module 'hyperpar.moe' has no attribute {name!r}")
