"""torch.compile inside a pipeline stage: each rank compiles the layers of its own stage
(``layer.compile()``, as torchtitan does per block) and the schedule drives them as usual.

PipelineModule over 2 real gloo ranks (one stage each, 2 residual-MLP blocks per stage), and
over 4 with each stage fully_shard-ed over 2 of them (each its rows of the batch, gradients
accumulated over the microbatches and reduce-scattered once per step), Schedule1F1B with 2
microbatches, AdamW, 3 steps, backend ``aot_eager``: no graph break, no
graph compiled after the first step, and the gradients (checked before every optimizer step)
and the parameters after the last step match the same blocks trained in plain torch in one
process on the whole batch (float32, rtol = atol = 1e-5: the microbatch gradients are summed
in another order, ~1e-7 relative; AdamW sees the same gradients on both sides).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from _dynamo_counts import check_grads_then_step, dynamo_counts, reset_dynamo  # noqa: E402

from hyperpar.testing.parity import assert_close_to_reference  # noqa: E402
from tests._pipeline_mlp import BATCH, N_BLOCKS, SEED, Block, _data, _full, _loss, _reference  # noqa: E402

STEPS = 3


def _compiled_stage(dims: tuple[str, ...]) -> dict[str, int]:
    """``("pp",)``: 2 stages; ``("pp", "dp")``: 2 stages, each fully_shard-ed over 2 ranks
    (gradients accumulated over the microbatches, reduce-scattered once per step)."""
    from hyperpar import fully_shard, init_device_mesh
    from hyperpar.pipeline import LayerSpec, PipelineModule, Schedule1F1B

    reset_dynamo()
    mesh = init_device_mesh((2,) * len(dims), mesh_dim_names=dims)
    pipe = PipelineModule([LayerSpec(Block) for _ in range(N_BLOCKS)], mesh=mesh,
                          mesh_dim="pp", loss_fn=_loss, seed_layers=True, base_seed=SEED,
                          partition_method="uniform")
    layers = [m for m in pipe.modules() if isinstance(m, Block)]  # this stage's blocks
    assert len(layers) == N_BLOCKS // 2
    for layer in layers:
        layer.compile(backend="aot_eager")
        if "dp" in dims:
            fully_shard(layer, mesh=mesh["dp"])
    if "dp" in dims:
        fully_shard(pipe, mesh=mesh["dp"])
    rows = slice(None)
    if "dp" in dims:
        dp = mesh.get_local_rank("dp")
        rows = slice(dp * BATCH // 2, (dp + 1) * BATCH // 2)
    reference = _reference()
    schedule = Schedule1F1B(pipe, n_microbatches=2)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    counts = {}
    for step in range(STEPS):
        x, y = _data(step)
        _loss(reference(x), y).backward()
        if "dp" in dims:
            pipe.set_requires_gradient_sync(False)
        schedule.step(x[rows], target=y[rows])
        if "dp" in dims:
            pipe.sync_gradients()
        grads = {n: _full(p.grad) for n, p in pipe.named_parameters()}
        ref_grads = {n: p.grad for n, p in reference.named_parameters() if n in grads}
        assert grads and len(grads) == len(ref_grads), (sorted(grads), sorted(ref_grads))
        check_grads_then_step(grads, ref_grads, step, opt, ref_opt)
        if step == 0:
            counts["graphs_first"] = dynamo_counts()[1]
    counts["breaks"], counts["graphs"] = dynamo_counts()
    params = {n: _full(p).detach() for n, p in pipe.named_parameters()}
    ref = {n: p.detach() for n, p in reference.named_parameters() if n in params}
    assert_close_to_reference(params, ref, what="params after AdamW")
    reset_dynamo()
    return counts


@pytest.mark.parametrize("dims", [("pp",), ("pp", "dp")], ids=["pp2", "pp2xdp2_fully_shard"])
def test_pipeline_stage_compiled_per_block_matches_one_process(run_on_ranks, dims):
    for counts in run_on_ranks(2 ** len(dims), _compiled_stage, dims):
        assert counts["breaks"] == 0, counts
        assert 0 < counts["graphs"] <= N_BLOCKS // 2, counts
        assert counts["graphs"] == counts["graphs_first"], f"recompiled after step 0: {counts}"
