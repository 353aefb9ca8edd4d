"""Under HYPERPAR_DEBUG_COLLECTIVES=1 a parallelized module checks what it is fed: Replicate
inputs equal on every rank, Shard inputs torch.chunk's pieces of one tensor (not the full
tensor on every rank). A bad input raises on every rank naming the module and the rank. An odd
sequence given to SequenceParallel as plain pieces raises at the first gather of its output
instead of a gloo abort on one rank and a wrong global length on the other."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from hyperpar.testing import WorkerPool


def _tp_mlp_input(case: str) -> str:
    from hyperpar.dtensor import init_device_mesh
    from hyperpar.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    mesh = init_device_mesh((2,))
    rank = mesh.get_local_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 8), nn.Linear(8, 4))
    plan = {"1": ColwiseParallel(), "2": RowwiseParallel()}
    if case.startswith("sp"):
        plan = {"0": SequenceParallel()}
    parallelize_module(model, mesh, plan)
    full = torch.randn(2, 6, 4, generator=torch.Generator().manual_seed(1))
    if case == "different_batches":
        x = torch.randn(2, 6, 4, generator=torch.Generator().manual_seed(10 + rank))
    elif case == "sp_full_sequence":
        x = full
    elif case == "sp_wrong_split":   # lengths 2 and 4: not torch.chunk's 3 and 3
        x = full[:, :2] if rank == 0 else full[:, 2:]
    elif case == "sp_good":
        x = full.tensor_split(2, dim=1)[rank]
    else:
        x = full
    target = model[0] if case.startswith("sp") else model
    try:
        target(x)
    except ValueError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.fixture(scope="module")
def debug_pool():
    with WorkerPool(2, backend=os.environ.get("HYPERPAR_BACKEND") or None,
                    env={"HYPERPAR_DEBUG_COLLECTIVES": "1"}, collective_timeout_s=30) as pool:
        yield pool


def test_replicated_input_that_differs_across_ranks_is_named(debug_pool):
    for message in debug_pool.run(_tp_mlp_input, "different_batches", timeout_s=60):
        assert message.startswith("InputLayoutError: '1' (ColwiseParallel), input 0: the input "
                                  "must be replicated"), message
        assert "rank(s) 1 hold a different one than rank 0" in message


def test_full_sequence_fed_to_sequence_parallel_is_named(debug_pool):
    for message in debug_pool.run(_tp_mlp_input, "sp_full_sequence", timeout_s=60):
        assert message.startswith("InputLayoutError: '0' (SequenceParallel), input 0"), message
        assert "was the full tensor passed instead of this rank's shard?" in message


def test_shards_that_are_not_torch_chunks_pieces_are_named(debug_pool):
    for message in debug_pool.run(_tp_mlp_input, "sp_wrong_split", timeout_s=60):
        assert message.startswith("InputLayoutError: '0' (SequenceParallel), input 0"), message
        assert "lengths [3, 3] along dim 1" in message
        assert "rank 0: (2, 2, 4), rank 1: (2, 4, 4)" in message


@pytest.mark.parametrize("case", ["same_batch", "sp_good"])
def test_correct_inputs_pass_the_checks(debug_pool, case):
    assert debug_pool.run(_tp_mlp_input, case, timeout_s=60) == ["no error"] * 2


def test_without_the_debug_flag_nothing_is_checked(run_on_ranks):
    # the documented torch behaviour: a different batch per rank is not detected
    assert run_on_ranks(2, _tp_mlp_input, "different_batches") == ["no error"] * 2


def _sequence_parallel_odd(then: str) -> str:
    from hyperpar.dtensor import init_device_mesh
    from hyperpar.parallel import ColwiseParallel, SequenceParallel, parallelize_module

    mesh = init_device_mesh((2,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 4))
    plan = {"0": SequenceParallel(use_local_output=False)}
    if then == "colwise":
        plan["1"] = ColwiseParallel()
    parallelize_module(model, mesh, plan)
    local = torch.randn(2, 5, 4).tensor_split(2, dim=1)[mesh.get_local_rank()]
    try:
        out = model[0](local) if then == "gather" else model(local)
        if then == "gather":
            out.full_tensor()
    except ValueError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.parametrize("then", ["gather", "colwise"])
def test_sequence_parallel_with_an_odd_length_raises_on_every_rank(debug_pool, then):
    for message in debug_pool.run(_sequence_parallel_odd, then, timeout_s=60):
        assert message.startswith("UnevenShardsError: SequenceParallel on LayerNorm"), message
        assert "rank 0 holds 3, rank 1 holds 2" in message
        assert "divisible by the mesh size (2)" in message
