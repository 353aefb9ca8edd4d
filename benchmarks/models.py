"""Models shared by the benchmarks (``hyperpar bench`` runs only ``bench_<name>.py`` files)."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    """Residual ReLU MLP block: x + down(relu(up(x))), hidden size 4 * dim."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))
