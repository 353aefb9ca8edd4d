"""The shared multi-process harness fixture works (real gloo processes)."""

import torch

from hyperpar.platform import get_platform


def _sum_of_ranks() -> float:
    platform = get_platform()
    t = torch.tensor([float(platform.rank())])
    platform.all_reduce(t)
    return t.item()


def test_all_reduce_on_two_ranks_sums_rank_ids(run_on_ranks):
    assert run_on_ranks(2, _sum_of_ranks) == [1.0, 1.0]
