"""Composition with pipelines on 4 and 8 real ranks: dp2 x pp2, pp2 x tp2 and pp2 x dp2 x tp2
train a stack of MLP blocks exactly like one process on the full batch (gradients at every
step, parameters after SGD; float32, rtol = atol = 1e-5).

Rank placement, ``init_device_mesh((2, 2), (a, b))`` -> grid [[0, 1], [2, 3]]: the groups of the
second dim are the rows {0, 1} and {2, 3}, the groups of the first dim the columns {0, 2} and
{1, 3}. So with ("dp", "pp") pipelines are {0, 1} and {2, 3} (stage = column) and replicas of a
stage are {0, 2}, {1, 3}; with ("pp", "tp") stage 0 is ranks {0, 1} (tp pair), stage 1 is
{2, 3}, and activations flow 0 -> 2 and 1 -> 3.
"""

from __future__ import annotations

import torch
from torch import nn

from hyperpar.parallel.data_parallel import data_parallel
from hyperpar.testing.parity import assert_close_to_reference
from tests._pipeline_mlp import (
    BATCH,
    N_BLOCKS,
    SEED,
    STEPS,
    Block,
    _data,
    _full,
    _loss,
    _reference,
)

LR = 0.1


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _sgd(model: nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            _local(p).add_(_local(p.grad), alpha=-LR)
            p.grad = None


def _pipeline(mesh, tp: bool):
    from hyperpar.pipeline import LayerSpec, PipelineModule

    pipe = PipelineModule([LayerSpec(Block) for _ in range(N_BLOCKS)], mesh=mesh,
                          mesh_dim="pp", loss_fn=_loss, seed_layers=True, base_seed=SEED,
                          partition_method="uniform")
    if tp:
        from hyperpar.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        parallelize_module(pipe, mesh["tp"], {"*.up": ColwiseParallel(),
                                              "*.down": RowwiseParallel()})
    return pipe


def _train(dims: tuple[str, ...]) -> None:
    from hyperpar.dtensor import init_device_mesh
    from hyperpar.pipeline import Schedule1F1B

    mesh = init_device_mesh((2,) * len(dims), mesh_dim_names=dims)
    pipe = _pipeline(mesh, tp="tp" in dims)
    reference = _reference()
    dp = mesh.get_local_rank("dp") if "dp" in dims else None
    if dp is not None:
        data_parallel(pipe, mesh, "dp")
    rows = slice(None) if dp is None else slice(dp * BATCH // 2, (dp + 1) * BATCH // 2)
    schedule = Schedule1F1B(pipe, n_microbatches=2)
    for step in range(STEPS):
        x, y = _data(step)
        _loss(reference(x), y).backward()
        if dp is None:
            schedule.step(x[rows], target=y[rows])
        else:
            with pipe.no_sync():  # one backward per microbatch: average once, at the end
                schedule.step(x[rows], target=y[rows])
            pipe.sync_gradients()
        grads = {n: _full(p.grad) for n, p in pipe.named_parameters()}
        ref_grads = {n: p.grad for n, p in reference.named_parameters() if n in grads}
        assert grads and len(grads) == len(ref_grads)
        assert_close_to_reference(grads, ref_grads, what=f"step {step} grads")
        _sgd(pipe)
        _sgd(reference)
    params = {n: _full(p).detach() for n, p in pipe.named_parameters()}
    ref = {n: p.detach() for n, p in reference.named_parameters() if n in params}
    assert_close_to_reference(params, ref, what="params after SGD")


def test_dp2_pp2_matches_one_process_on_the_full_batch(run_on_ranks):
    run_on_ranks(4, _train, ("dp", "pp"))


def test_pp2_tp2_matches_one_process(run_on_ranks):
    run_on_ranks(4, _train, ("pp", "tp"))


def test_pp2_dp2_tp2_on_eight_ranks_matches_one_process(run_on_ranks):
    # grid [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]: stage 0 = ranks 0-3, stage 1 = ranks 4-7;
    # tp pairs {0, 1}, {2, 3}, ...; dp pairs {0, 2}, {1, 3}, ...; pipelines {0, 4}, {1, 5}, ...
    run_on_ranks(8, _train, ("pp", "dp", "tp"))
