"""Tensor-parallel boundaries with uneven pieces, and styles applied twice (2 and 4 real ranks).

Parity: against the same module in one process, float32, rtol = atol = 1e-5
(hyperpar.testing.parity defaults).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from hyperpar.dtensor import DTensor, Replicate, Shard, init_device_mesh
from hyperpar.dtensor.placement import chunk_bounds
from hyperpar.parallel import (
    AlreadyParallelizedError,
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    distribute_module,
    parallelize_module,
)
from hyperpar.platform import get_platform
from hyperpar.testing import assert_close_to_reference


def _mesh():
    return init_device_mesh((get_platform().world_size(),), mesh_dim_names=("tp",))


def _piece(full: torch.Tensor, dim: int) -> torch.Tensor:
    """This rank's torch.chunk piece (possibly empty: chunk() would drop it)."""
    n, rank = get_platform().world_size(), get_platform().rank()
    return full.narrow(dim, *chunk_bounds(full.shape[dim], n, rank)).clone()


def _grads(model):
    return {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
            for n, p in model.named_parameters()}


# ------------------------------------------------------------------------- uneven gathers
def _uneven_mlp_matches_one_process() -> None:
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(4, 7), nn.ReLU(), nn.Linear(7, 5), nn.Linear(5, 3))
    model = parallelize_module(copy.deepcopy(reference), _mesh(), {
        "0": ColwiseParallel(), "2": RowwiseParallel(),
        "3": ColwiseParallel(output_layouts=Replicate())})  # 3 features over n ranks
    x = torch.randn(6, 4)
    want = reference(x)
    want.square().sum().backward()
    got = model(x)
    assert got.shape == (6, 3)
    assert_close_to_reference(got, want.detach())
    got.square().sum().backward()
    assert_close_to_reference(_grads(model), _grads(reference), what="grads")


@pytest.mark.parametrize("world_size", [2, 4])
def test_colwise_replicated_output_with_uneven_features_matches_one_process(run_on_ranks,
                                                                            world_size):
    run_on_ranks(world_size, _uneven_mlp_matches_one_process)


def _odd_sequence_sharded_input(output_layout) -> None:
    torch.manual_seed(0)
    reference = nn.Linear(4, 6)
    model = parallelize_module(copy.deepcopy(reference), _mesh(),
                               ColwiseParallel(input_layouts=Shard(1),
                                               output_layouts=output_layout))
    x = torch.randn(2, 5, 4)
    x_ref = x.clone().requires_grad_()
    want = reference(x_ref)
    want.square().sum().backward()
    x_local = _piece(x, 1).requires_grad_()
    got = model(x_local)
    want_local = want.detach() if output_layout == Replicate() else _piece(want.detach(), -1)
    assert_close_to_reference(got, want_local)
    got.square().sum().backward()
    assert_close_to_reference(x_local.grad, _piece(x_ref.grad, 1), what="input grad")
    assert_close_to_reference(_grads(model), _grads(reference), what="grads")


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("output_layout", [Replicate(), Shard(-1)], ids=["replicate", "shard"])
def test_colwise_odd_sequence_length_input_matches_one_process(run_on_ranks, world_size,
                                                               output_layout):
    run_on_ranks(world_size, _odd_sequence_sharded_input, output_layout)


def _prepare_input_gathers_uneven_dtensor_and_plain() -> None:
    full = torch.arange(2.0 * 5 * 3).reshape(2, 5, 3)
    for use_local in (True, False):
        mod = parallelize_module(nn.Identity(), _mesh(), PrepareModuleInput(
            input_layouts=Shard(1), desired_input_layouts=Replicate(),
            use_local_output=use_local))
        out = mod(_piece(full, 1))
        out = out if use_local else out.to_local()
        assert torch.equal(out, full)
    dt = DTensor.from_local(_piece(full, 1), _mesh(), [Shard(1)], shape=full.shape)
    mod = parallelize_module(nn.Identity(), _mesh(), PrepareModuleInput(
        input_layouts=Shard(1), desired_input_layouts=Shard(2), use_local_output=False))
    out = mod(dt)
    assert out.placements == (Shard(2),) and out.shape == full.shape
    assert torch.equal(out.full_tensor(), full)


def test_prepare_module_input_regathers_uneven_pieces(run_on_ranks):
    run_on_ranks(2, _prepare_input_gathers_uneven_dtensor_and_plain)


def _pieces_that_are_not_a_chunk_split() -> str:
    rank = get_platform().rank()
    model = parallelize_module(nn.Linear(4, 6), _mesh(), ColwiseParallel(input_layouts=Shard(1)))
    x = torch.randn(2, 2 if rank == 0 else 3, 4)  # [2, 3]: torch.chunk of 5 gives [3, 2]
    try:
        model(x)
    except ValueError as err:
        return str(err)
    raise AssertionError("no error")


def test_pieces_that_are_not_a_torch_chunk_split_raise_on_every_rank(run_on_ranks):
    messages = run_on_ranks(2, _pieces_that_are_not_a_chunk_split)
    for msg in messages:
        assert "lengths [2, 3]" in msg and "torch.chunk's pieces [3, 2]" in msg, msg


# ------------------------------------------------------------------------- applied twice
def _parallelize_twice_raises_and_changes_nothing() -> None:
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    model = copy.deepcopy(reference)
    mesh = _mesh()
    parallelize_module(model, mesh, {"0": ColwiseParallel()})
    with pytest.raises(AlreadyParallelizedError, match=r"'0' \(Linear\) is already parallelized"):
        # re-running a notebook cell: the new entry for "2" must not be applied either
        parallelize_module(model, mesh, {"2": RowwiseParallel(), "0": ColwiseParallel()})
    assert not isinstance(model[2].weight, DTensor)
    parallelize_module(model, mesh, {"2": RowwiseParallel()})
    x = torch.randn(3, 4)
    assert_close_to_reference(model(x), reference(x).detach())  # not doubled
    with pytest.raises(AlreadyParallelizedError, match="'2' .* is already parallelized"):
        parallelize_module(model, mesh, {"2": ColwiseParallel()})
    with pytest.raises(AlreadyParallelizedError, match="the root module .* already"):
        RowwiseParallel().apply(model[0], mesh)
    with pytest.raises(AlreadyParallelizedError, match="distribute_module: '0'"):
        distribute_module(model, mesh)
    twice = nn.Sequential(nn.Linear(4, 8))
    with pytest.raises(AlreadyParallelizedError, match="'0'"):  # one plan, two keys, one module
        parallelize_module(twice, mesh, {"*": ColwiseParallel(), "0": ColwiseParallel()})
    assert not isinstance(twice[0].weight, DTensor)
    block = nn.Sequential(nn.Linear(4, 4))
    distribute_module(block, mesh)
    with pytest.raises(AlreadyParallelizedError, match="are DTensors already"):
        parallelize_module(block, mesh, {"0": ColwiseParallel()})
    with pytest.raises(AlreadyParallelizedError, match="distribute_module: the root module"):
        distribute_module(block, mesh)


def test_parallelizing_an_already_parallelized_module_raises_before_any_change(run_on_ranks):
    run_on_ranks(2, _parallelize_twice_raises_and_changes_nothing)


def _input_and_sharding_styles_on_one_module() -> None:
    torch.manual_seed(0)
    reference = nn.Linear(4, 6)
    model = copy.deepcopy(reference)
    mesh = _mesh()
    parallelize_module(model, mesh, PrepareModuleInput(
        input_layouts=Shard(0), desired_input_layouts=Replicate(), use_local_output=False))
    parallelize_module(model, mesh, ColwiseParallel(output_layouts=Replicate()))
    x = torch.randn(4, 4)
    assert_close_to_reference(model(_piece(x, 0)), reference(x).detach())
    with pytest.raises(AlreadyParallelizedError, match="PrepareModuleInput"):
        parallelize_module(model, mesh, PrepareModuleInput(
            input_layouts=Shard(0), desired_input_layouts=Replicate()))


def test_an_input_style_and_a_sharding_style_may_share_a_module(run_on_ranks):
    run_on_ranks(2, _input_and_sharding_styles_on_one_module)
