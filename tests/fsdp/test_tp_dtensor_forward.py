"""fully_shard x tensor parallelism with per-op DTensor code inside ``forward`` (torchtitan's
attention, rope and ``local_map`` code: ``x @ w.t()`` where ``w`` is the module's colwise
weight). As in torch FSDP2, a parameter that was a TP DTensor before ``fully_shard`` is handed
to the module during forward/backward as a DTensor on its TP mesh with its TP placements (its
local tensor: the all-gathered dp shard), and its gradient reaches the dp x tp shard.

Compared with the same model in one plain-torch process on the whole batch: values after each
step and the gradients of the first step (tolerance: fp32 sums of at most 16 products in
another order, ~1e-6; 1e-5 leaves margin and fails on any wrong step, ~1e-2 moves)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

STEPS, ROWS, TOL = 3, 8, 1e-5


class _Net(nn.Module):
    """colwise ``w1`` [16, 8], rowwise ``w2`` [8, 16], a replicated scale ``g`` [8]."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.w1 = nn.Parameter(torch.randn(16, 8, generator=gen) * 0.3)
        self.w2 = nn.Parameter(torch.randn(8, 16, generator=gen) * 0.3)
        self.g = nn.Parameter(1.0 + 0.1 * torch.randn(8, generator=gen))
        self.tp_mesh = None  # set on the ranks: forward then runs per-op DTensor code
        self.seen: list[tuple] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_mesh is None:
            return (torch.relu(x @ self.w1.t()) @ self.w2.t()) * self.g
        from hyperpar.dtensor import DTensor
        from hyperpar.dtensor.placement import Replicate

        self.seen.append(tuple(
            (type(p).__name__, tuple(getattr(p, "placements", ())))
            for p in (self.w1, self.w2, self.g)))
        xd = DTensor.from_local(x, self.tp_mesh, [Replicate()])
        h = torch.relu(xd @ self.w1.t())            # Shard(-1)
        y = (h @ self.w2.t()).redistribute(self.tp_mesh, [Replicate()])  # Partial -> Replicate
        return (y * self.g).to_local()


def _batch(step: int) -> torch.Tensor:
    return torch.randn(ROWS, 8, generator=torch.Generator().manual_seed(step))


def _train(model: nn.Module, rows: slice) -> tuple[list[dict], list[float]]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    states, losses = [], []
    for step in range(STEPS):
        opt.zero_grad()
        x = _batch(step)[rows]
        loss = model(x).pow(2).sum() / x.shape[0]  # fully_shard averages over dp ranks
        loss.backward()
        losses.append(float(loss.detach()))
        state = {}
        for k, p in model.named_parameters():
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            state[k] = (full.detach().clone(), grad.detach().clone())
        opt.step()
        states.append(state)
    final = {k: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
             for k, p in model.named_parameters()}
    states.append({k: (v, None) for k, v in final.items()})
    return states, losses


def _fsdp_tp(shape: tuple[int, int]) -> dict:
    from hyperpar import fully_shard, init_device_mesh
    from hyperpar.dtensor import distribute_tensor
    from hyperpar.dtensor.placement import Replicate, Shard

    mesh = init_device_mesh(shape, mesh_dim_names=("dp", "tp"))
    tp_mesh, dp_mesh = mesh["tp"], mesh["dp"]
    model = _Net()
    for name, place in (("w1", Shard(0)), ("w2", Shard(1)), ("g", Replicate())):
        full = getattr(model, name).detach()
        setattr(model, name, nn.Parameter(distribute_tensor(full, tp_mesh, [place])))
    model.tp_mesh = tp_mesh
    fully_shard(model, mesh=dp_mesh)
    per = ROWS // dp_mesh.size()
    r = dp_mesh.get_local_rank()
    states, _ = _train(model, slice(r * per, (r + 1) * per))
    return {"states": states, "seen": model.seen}


@pytest.mark.parametrize(("n", "shape"), [(2, (1, 2)), (4, (2, 2))])
def test_per_op_dtensor_tp_inside_fully_shard_matches_one_process(run_on_ranks, n, shape):
    from hyperpar.dtensor.placement import Replicate, Shard

    ref, _ = _train(_Net(), slice(None))
    for res in run_on_ranks(n, _fsdp_tp, shape):
        # the module saw TP DTensors with their TP placements, in every forward
        assert res["seen"] == [(("DTensor", (Shard(0),)), ("DTensor", (Shard(1),)),
                                ("DTensor", (Replicate(),)))] * STEPS, res["seen"]
        for step, (got, want) in enumerate(zip(res["states"], ref, strict=True)):
            for k, (value, grad) in want.items():
                torch.testing.assert_close(got[k][0], value, atol=TOL, rtol=TOL,
                                           msg=f"{k} value before step {step}")
                if grad is not None:
                    torch.testing.assert_close(got[k][1], grad, atol=TOL, rtol=TOL,
                                               msg=f"{k} grad of step {step}")
