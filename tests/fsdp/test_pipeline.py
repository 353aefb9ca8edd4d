"""fully_shard inside pipeline stages: PipelineModule + Schedule1F1B + fully_shard on a
(pp, dp) mesh trains like one process on the full batch (AdamW; gradients checked every step;
float32, rtol = atol = 1e-5). Gradients accumulate unsharded over the microbatches
(``set_requires_gradient_sync(False)``) and are reduce-scattered once per step
(``sync_gradients()``), not once per microbatch.

Rank placement: ``init_device_mesh((2, 2), ("pp", "dp"))`` -> grid [[0, 1], [2, 3]]: stage 0 is
ranks {0, 1} (one dp group, sharding stage 0's layers between them), stage 1 is {2, 3};
pipelines are {0, 2} and {1, 3}. With ("pp", "dp", "tp") on 8 ranks, stage 0 = ranks 0-3.
"""

from __future__ import annotations

import torch

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


def _train(dims: tuple[str, ...]) -> int:
    from hyperpar import fully_shard, init_device_mesh
    from hyperpar.pipeline import LayerSpec, PipelineModule, Schedule1F1B

    mesh = init_device_mesh((2,) * len(dims), mesh_dim_names=dims)
    pipe = PipelineModule([LayerSpec(Block) for _ in range(N_BLOCKS)], mesh=mesh,
                          mesh_dim="pp", loss_fn=_loss, seed_layers=True, base_seed=SEED,
                          partition_method="uniform")
    if "tp" in dims:
        from hyperpar.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        parallelize_module(pipe, mesh["tp"], {"*.up": ColwiseParallel(),
                                              "*.down": RowwiseParallel()})
    for layer in [m for m in pipe.modules() if isinstance(m, Block)]:  # this stage's layers
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(pipe, mesh=mesh["dp"])
    reduce_scatters = 0
    group_cls = type(pipe._fsdp_group)
    original = group_cls.reduce_grads

    def counting(self):
        nonlocal reduce_scatters
        reduce_scatters += 1
        return original(self)

    group_cls.reduce_grads = counting
    try:
        reference = _reference()
        dp = mesh.get_local_rank("dp")
        rows = slice(dp * BATCH // 2, (dp + 1) * BATCH // 2)
        schedule = Schedule1F1B(pipe, n_microbatches=2)
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
        for step in range(STEPS):
            x, y = _data(step)
            _loss(reference(x), y).backward()
            pipe.set_requires_gradient_sync(False)
            schedule.step(x[rows], target=y[rows])
            pipe.sync_gradients()  # one reduce-scatter per group per step
            grads = {n: _full(p.grad) for n, p in pipe.named_parameters()}
            ref_grads = {n: p.grad for n, p in reference.named_parameters() if n in grads}
            assert grads and len(grads) == len(ref_grads)
            assert_close_to_reference(grads, ref_grads, what=f"step {step} grads")
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
        params = {n: _full(p).detach() for n, p in pipe.named_parameters()}
        ref = {n: p.detach() for n, p in reference.named_parameters() if n in params}
        assert_close_to_reference(params, ref, what="params after AdamW")
    finally:
        group_cls.reduce_grads = original
    return reduce_scatters


def test_pp2_x_dp2_reduce_scatters_once_per_step_and_matches_one_process(run_on_ranks):
    counts = run_on_ranks(4, _train, ("pp", "dp"))
    # each rank holds 2 fully_shard layers (the stage root has no parameters of its own):
    # 2 reduce-scatters per step over 2 steps -- per microbatch it would be 8
    assert counts == [2 * 2] * 4, counts


def test_pp2_dp2_tp2_on_eight_ranks_matches_one_process(run_on_ranks):
    run_on_ranks(8, _train, ("pp", "dp", "tp"))
