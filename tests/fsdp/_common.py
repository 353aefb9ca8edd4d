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

__all__ = ["ARGS", "BATCH", "LR", "STEPS", "full_state", "llama", "plans", "rank_rows",
           "reference_state", "shard_blocks", "train"]


def rank_rows(dp_rank: int, dp_size: int) -> slice:
    """This data-parallel rank's rows of the global batch."""
    per = BATCH // dp_size
    return slice(dp_rank * per, (dp_rank + 1) * per)


def shard_blocks(model: nn.Module, **kw) -> nn.Module:
    """fully_shard every transformer block, then the root (the FSDP2 recipe)."""
    from hyperpar import fully_shard

    for layer in model.layers:
        fully_shard(layer, **kw)
    return fully_shard(model, **kw)


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: full(p.detach()).clone() for n, p in model.named_parameters()}


def loss_of(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def train(model: nn.Module, rows: slice, *, steps: int = STEPS, accumulate: int = 1,
          args: llama.ModelArgs = ARGS,
          before_step: Callable[[nn.Module], None] | None = None,
          sync: Callable[[nn.Module, bool], None] | None = None) -> list[float]:
    """AdamW on batch rows ``rows`` of each step's batch; returns the losses (of the rows)."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    losses = []
    for step in range(steps):
        tokens, labels = llama.batch(args, batch_size=BATCH, seed=step)
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


def reference_state(steps: int = STEPS, args: llama.ModelArgs = ARGS,
                    **kw) -> dict[str, torch.Tensor]:
    model = llama.build(args, seed=0)
    train(model, slice(0, BATCH), steps=steps, args=args, **kw)
    return full_state(model)
