"""Gradients through the differentiable collectives equal the analytic ones.

Each rank feeds its own input and weights its output with its own weights; the total loss is
the sum over ranks. Every process rebuilds all ranks' inputs, evaluates the same collective as
plain tensor algebra with autograd, and compares its own input gradient with the distributed one.
"""

from __future__ import annotations

import pytest
import torch

from hyperpar.platform import get_platform
from hyperpar.testing.conformance.inputs import rank_tensor

SHAPE = (4, 6)


def _reference(name: str, xs: list[torch.Tensor], r: int, n: int) -> torch.Tensor:
    if name == "all_reduce_sum":
        return torch.stack(xs).sum(0)
    if name == "all_reduce_avg":
        return torch.stack(xs).mean(0)
    if name == "all_gather_dim1":
        return torch.cat(xs, dim=1)
    if name == "reduce_scatter_dim1":
        return torch.stack(xs).sum(0).chunk(n, dim=1)[r]
    if name == "all_to_all_1_0":
        return torch.cat([x.chunk(n, dim=1)[r] for x in xs], dim=0)
    raise KeyError(name)


def _distributed(name: str, x: torch.Tensor) -> torch.Tensor:
    p = get_platform()
    if name == "all_reduce_sum":
        return p.all_reduce_autograd(x, "sum")
    if name == "all_reduce_avg":
        return p.all_reduce_autograd(x, "avg")
    if name == "all_gather_dim1":
        return p.all_gather_autograd(x, dim=1)
    if name == "reduce_scatter_dim1":
        return p.reduce_scatter_autograd(x, dim=1)
    if name == "all_to_all_1_0":
        return p.all_to_all_autograd(x, split_dim=1, concat_dim=0)
    raise KeyError(name)


def _check(name: str) -> None:
    p = get_platform()
    n, r = p.world_size(), p.rank()
    shape = (SHAPE[0], SHAPE[1] * n // 2 * 2)  # divisible by n along dim 1 for 2 and 4 ranks
    x = rank_tensor(r, shape, salt=7).to(p.device()).requires_grad_(True)
    y = _distributed(name, x)
    w = rank_tensor(r, tuple(y.shape), salt=8).to(p.device())
    (y * w).sum().backward()

    xs = [rank_tensor(i, shape, salt=7).requires_grad_(True) for i in range(n)]
    total = sum(
        (_reference(name, xs, i, n) * rank_tensor(i, tuple(y.shape), salt=8)).sum()
        for i in range(n)
    )
    total.backward()
    torch.testing.assert_close(y.detach().cpu(), _reference(name, xs, r, n).detach())
    torch.testing.assert_close(x.grad.cpu(), xs[r].grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["all_reduce_sum", "all_reduce_avg", "all_gather_dim1",
                                  "reduce_scatter_dim1", "all_to_all_1_0"])
def test_autograd_collective_gradient_equals_analytic(run_on_ranks, world_size, name):
    run_on_ranks(world_size, _check, name)
