"""PipelineEngine over a fully_shard-ed PipelineModule on a ("pp", "dp") mesh: the engine lets
fully_shard reduce-scatter once per step (its sync_gradients) and averages the loss over dp.
Importable by spawned ranks."""

from __future__ import annotations

import torch
from torch import nn

from hyperpar.testing import assert_close_to_reference

N_BLOCKS, DIM, MICRO, GAS, STEPS, SEED, LR = 4, 8, 2, 2, 2, 1234, 0.1


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


def _batches(step: int, dp_rank: int, dp: int) -> list[tuple]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(dp * GAS * MICRO, DIM, generator=g)
    y = torch.randn(dp * GAS * MICRO, DIM, generator=g)
    rows = [(x[i:i + MICRO], y[i:i + MICRO]) for i in range(0, len(x), MICRO)]
    return rows[dp_rank * GAS:(dp_rank + 1) * GAS]


def run() -> list[float]:
    from hyperpar import fully_shard, init_device_mesh
    from hyperpar.pipeline import LayerSpec, PipelineModule, initialize

    mesh = init_device_mesh((2, 2), mesh_dim_names=("pp", "dp"))
    pipe = PipelineModule([LayerSpec(Block) for _ in range(N_BLOCKS)], mesh=mesh, mesh_dim="pp",
                          loss_fn=nn.functional.mse_loss, seed_layers=True, base_seed=SEED,
                          partition_method="uniform")
    assert pipe.dp_size == 2
    for layer in [m for m in pipe.modules() if isinstance(m, Block)]:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(pipe, mesh=mesh["dp"])
    engine, *_ = initialize(model=pipe, config={
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "SGD", "params": {"lr": LR}}})
    blocks = []
    for i in range(N_BLOCKS):
        torch.manual_seed(SEED + i)
        blocks.append(Block())
    reference = nn.Sequential(*blocks)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    dp_rank = mesh.get_local_rank("dp")
    losses = []
    for step in range(STEPS):
        loss = engine.train_batch(iter(_batches(step, dp_rank, 2)))
        mbs = [mb for r in range(2) for mb in _batches(step, r, 2)]
        ref = sum(nn.functional.mse_loss(reference(x), y) for x, y in mbs) / len(mbs)
        ref.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert_close_to_reference(loss, ref.detach(), what=f"step {step} loss")
        losses.append(float(loss))
    full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
            for n, p in pipe.named_parameters()}
    ref_params = {n: p.detach() for n, p in reference.named_parameters() if n in full}
    assert full and len(full) == len(ref_params)
    assert_close_to_reference(full, ref_params, what="parameters after SGD")
    return losses
