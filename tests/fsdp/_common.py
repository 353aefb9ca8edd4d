"""Shared helpers of the fully_shard tests: the example Llama model, its batches, and a
one-process reference trained on the full batch."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from examples.llama import model as llama  # noqa: E402
from examples.llama import plan as plans  # noqa: E402

STEPS, BATCH, LR = 3, 4, 1e-2
ARGS = llama.ModelArgs.tiny()

__all__ = ["ARGS", "BATCH", "LR", "STEPS", "full_state", "llama", "plans", "reference_state",
           "train"]


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: full(p.detach()).clone() for n, p in model.named_parameters()}


def loss_of(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def train(model: nn.Module, rows: slice, *, steps: int = STEPS, accumulate: int = 1,
          before_step: Callable[[nn.Module], None] | None = None,
          sync: Callable[[nn.Module, bool], None] | None = None) -> list[float]:
    """AdamW on batch rows ``rows`` of each step's batch; returns the losses (of the rows)."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    losses = []
    for step in range(steps):
        tokens, labels = llama.batch(ARGS, batch_size=BATCH, seed=step)
        tokens, labels = tokens[rows], labels[rows]
        micro = tokens.shape[0] // accumulate
        for i in range(accumulate):
            if sync is not None:
                sync(model, i == accumulate - 1)
            part = slice(i * micro, (i + 1) * micro)
            loss = loss_of(model, tokens[part], labels[part]) / accumulate
            loss.backward()
            losses.append(loss.item())
        if before_step is not None:
            before_step(model)
        opt.step()
        opt.zero_grad()
    return losses


def reference_state(steps: int = STEPS, **kw) -> dict[str, torch.Tensor]:
    model = llama.build(ARGS, seed=0)
    train(model, slice(0, BATCH), steps=steps, **kw)
    return full_state(model)
