"""The residual-MLP pipeline model shared by the dp x pp and fsdp x pp parity tests, with its
single-process reference and data. Importable by spawned ranks."""

from __future__ import annotations

import torch
from torch import nn

N_BLOCKS, DIM, BATCH, STEPS, SEED = 4, 16, 8, 2, 1234


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


def _loss(y: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(y, target)


def _reference() -> nn.Module:
    blocks = []
    for i in range(N_BLOCKS):  # what PipelineModule(seed_layers=True) builds for layer i
        torch.manual_seed(SEED + i)
        blocks.append(Block())
    return nn.Sequential(*blocks)


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, DIM, generator=g), torch.randn(BATCH, DIM, generator=g)


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t
