"""Tensor-parallel MLP: train a 2-layer MLP sharded Megatron-style over every rank.

    hyperpar run -n 2 examples/tp_mlp.py [--steps 20] [--dim 64] [--hidden 256] [--batch 32]
    HYPERPAR_BACKEND=cpu hyperpar run -n 2 examples/tp_mlp.py

The model is plain PyTorch; the plan is data: ``up`` is split by output features
(``ColwiseParallel``), ``down`` by input features (``RowwiseParallel``), so the forward needs a
single all-reduce, after ``down``. Rank 0 prints a progress line per step and, at the end,
checks that the sharded model's loss matches the same model trained in one process.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from hyperpar.dtensor import init_device_mesh
from hyperpar.log import Progress, get_logger, rank0_print
from hyperpar.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from hyperpar.platform import get_platform


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


PLAN = {"up": ColwiseParallel(), "down": RowwiseParallel()}


def train(model: nn.Module, data: list[tuple[torch.Tensor, torch.Tensor]],
          progress: Progress | None) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    losses = []
    for x, y in data:
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if progress is not None:
            progress.step(loss)
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()

    platform = get_platform()
    platform.init_process_group()
    log = get_logger("tp_mlp")
    world = platform.world_size()
    mesh = init_device_mesh((world,), mesh_dim_names=("tp",))
    device = platform.device()

    # Same seed on every rank: identical initial weights and data (TP ranks see the same batch).
    torch.manual_seed(0)
    reference = MLP(args.dim, args.hidden).to(device)
    model = MLP(args.dim, args.hidden).to(device)
    model.load_state_dict(reference.state_dict())
    teacher = torch.randn(args.dim, args.dim, device=device) / args.dim ** 0.5
    inputs = [torch.randn(args.batch, args.dim, device=device) for _ in range(args.steps)]
    data = [(x, torch.tanh(x @ teacher)) for x in inputs]  # a target the MLP can learn

    parallelize_module(model, mesh, PLAN)
    log.info("tp_mlp: %d ranks on %s; up.weight is %s, local shard %s", world,
             platform.describe(), tuple(model.up.weight.shape),
             tuple(model.up.weight.to_local().shape))

    progress = Progress(total_steps=args.steps, tokens_per_step=args.batch)
    losses = train(model, data, progress)
    expected = train(reference, data, None)  # the same model, unsharded, in this process
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected),
                               rtol=1e-4, atol=1e-5)
    rank0_print(f"tp_mlp: OK -- loss {losses[0]:.4f} -> {losses[-1]:.4f}, equal to the "
                "single-process run", force=True)
    platform.destroy_process_group()


if __name__ == "__main__":
    main()
