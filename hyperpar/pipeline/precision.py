"""fp16/bf16 training for the pipeline engine: fp32 master weights and DeepSpeed's dynamic loss
scaling rule.

The model runs in half precision; the optimizer steps fp32 copies ("masters") of the trainable
parameters, which are copied back into the model after every step. With fp16 the loss is
multiplied by the loss scale before backward; a step whose gradients hold an inf or NaN on
any rank is skipped and the scale lowered.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["DynamicLossScaler", "MasterWeights"]


class DynamicLossScaler:
    """The loss scale, DeepSpeed's ``fp16`` rule.

    ``loss_scale`` > 0 fixes the scale; 0 (default) makes it dynamic: it starts at
    ``2 ** initial_scale_power``, halves (never below ``min_loss_scale``) once ``hysteresis``
    overflowing steps have been seen, and doubles after ``loss_scale_window`` steps in a row
    without overflow (``consecutive_hysteresis`` refills the hysteresis on every clean step).
    """

    def __init__(self, fp16: Mapping[str, Any]) -> None:
        static = float(fp16.get("loss_scale", 0) or 0)
        self.dynamic = static == 0
        self.scale = static if not self.dynamic else 2.0 ** int(fp16.get("initial_scale_power",
                                                                         16))
        self.window = int(fp16.get("loss_scale_window", 1000))
        self.min_scale = float(fp16.get("min_loss_scale", 1))
        self.hysteresis = int(fp16.get("hysteresis", 2))
        self.consecutive = bool(fp16.get("consecutive_hysteresis", False))
        self._left = self.hysteresis
        self._iter = 0
        self._last_overflow = -1

    def update(self, overflow: bool) -> None:
        """Account for one step that did (or did not) overflow."""
        if self.dynamic:
            if overflow:
                if self.hysteresis == 1 or self._left == 1:
                    self.scale = max(self.scale / 2.0, self.min_scale)
                else:
                    self._left -= 1
                self._last_overflow = self._iter
            else:
                if self.consecutive:
                    self._left = self.hysteresis
                if (self._iter - self._last_overflow) % self.window == 0:
                    if not self.consecutive:
                        self._left = self.hysteresis
                    self.scale *= 2.0
        self._iter += 1


class MasterWeights:
    """fp32 copies of ``params`` for the optimizer; the model keeps its half-precision ones."""

    def __init__(self, params: Sequence[torch.nn.Parameter]) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.masters = [torch.nn.Parameter(p.detach().float().clone()) for p in self.params]

    def adopt(self, optimizer: torch.optim.Optimizer) -> None:
        """Point ``optimizer``'s parameter groups at the masters instead of the model's
        parameters (before any step: the optimizer must hold no state yet)."""
        if optimizer.state:
            raise ValueError("PipelineEngine: with fp16/bf16 the optimizer must not have "
                             "stepped yet (its state would belong to the half-precision "
                             "parameters)")
        swap = {id(p): m for p, m in zip(self.params, self.masters, strict=True)}
        for group in optimizer.param_groups:
            missing = [p for p in group["params"] if id(p) not in swap]
            if missing:
                raise ValueError(f"PipelineEngine: the optimizer holds {len(missing)} tensors "
                                 f"that are not trainable parameters of this stage's model")
            group["params"] = [swap[id(p)] for p in group["params"]]

    def grads_to_masters(self, inv_scale: float) -> None:
        """``master.grad = param.grad / scale`` in fp32; the model's gradients are dropped."""
        for p, m in zip(self.params, self.masters, strict=True):
            m.grad = None if p.grad is None else p.grad.detach().float().mul_(inv_scale)
            p.grad = None

    def masters_to_model(self) -> None:
        with torch.no_grad():
            for p, m in zip(self.params, self.masters, strict=True):
                p.copy_(m)


def has_overflow(params: Sequence[torch.Tensor]) -> bool:
    """Whether any local gradient holds an inf or NaN (this rank only)."""
    for p in params:
        g = p.grad
        if g is not None and not bool(torch.isfinite(g).all()):
            return True
    return False
