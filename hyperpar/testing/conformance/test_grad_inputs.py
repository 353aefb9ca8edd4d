"""Collectives take tensors that require grad (parameters and views of them) with grad mode on.

The Platform's collectives are not autograd ops, but callers hand them parameters: fully_shard
all-gathers its shards, a checkpoint loader gathers weights. gloo once failed such an async
all-gather at ``wait()`` ("A view was created in no_grad mode and is being modified inplace")
depending on its worker thread's timing, so each case runs several times.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hyperpar.platform import get_platform
from hyperpar.testing.conformance.inputs import rank_tensor

REPEATS = 12  # the old failure depended on thread timing: one round could pass by luck


def _gather_params(async_op: bool) -> None:
    p = get_platform()
    n, r = p.world_size(), p.rank()
    dev = p.device()
    assert torch.is_grad_enabled()
    for i in range(REPEATS):
        param = nn.Parameter(rank_tensor(r, (4, 3), salt=10 + i).to(dev))
        with torch.no_grad():
            view = param[1:3]  # a view of a parameter made in no_grad mode, as fully_shard does
        for inp, rows in ((param, slice(0, 4)), (view, slice(1, 3))):
            out = torch.empty(n * (rows.stop - rows.start), 3, device=dev)
            work = p.all_gather_into_tensor(out, inp, async_op=async_op)
            if async_op:
                work.wait()
            expected = torch.cat([rank_tensor(k, (4, 3), salt=10 + i)[rows] for k in range(n)])
            torch.testing.assert_close(out.cpu(), expected)
        assert param.grad is None and param.grad_fn is None  # nothing leaked into autograd


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
def test_all_gather_accepts_parameters_with_grad_mode_on(run_on_ranks, world_size, async_op):
    run_on_ranks(world_size, _gather_params, async_op)


def _reduce_scatter_params(async_op: bool) -> None:
    p = get_platform()
    n, r = p.world_size(), p.rank()
    dev = p.device()
    for i in range(REPEATS):
        param = nn.Parameter(rank_tensor(r, (2 * n, 3), salt=40 + i).to(dev))
        out = torch.empty(2, 3, device=dev)
        work = p.reduce_scatter_tensor(out, param, "sum", async_op=async_op)
        if async_op:
            work.wait()
        full = torch.stack([rank_tensor(k, (2 * n, 3), salt=40 + i) for k in range(n)]).sum(0)
        torch.testing.assert_close(out.cpu(), full[2 * r:2 * r + 2], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
def test_reduce_scatter_accepts_parameters_with_grad_mode_on(run_on_ranks, world_size,
                                                             async_op):
    run_on_ranks(world_size, _reduce_scatter_params, async_op)
