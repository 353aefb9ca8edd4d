"""fully_shard composed with other parallelisms matches one process on the full batch
(AdamW, float32, rtol = atol = 1e-5):

* HSDP on a (replicate=2, shard=2) mesh: ranks [[0, 1], [2, 3]] -- shard groups {0, 1} and
  {2, 3}, replicate groups {0, 2} and {1, 3}; four data-parallel ranks in all.
* dp2 x tp2: tensor parallelism inside (mesh["tp"]), fully_shard outside (mesh["dp"]); every
  parameter is a DTensor over (tp, dp) and ``full_tensor()`` is the whole weight.
"""

from __future__ import annotations

import torch

from hyperpar.testing.parity import assert_close_to_reference

from ._common import ARGS, full_state, llama, plans, rank_rows, reference_state, shard_blocks, train


def _hsdp() -> dict[str, torch.Tensor]:
    from hyperpar import init_device_mesh
    from hyperpar.dtensor.placement import Replicate, Shard

    mesh = init_device_mesh((2, 2), mesh_dim_names=("replicate", "shard"))
    model = shard_blocks(llama.build(ARGS, seed=0), mesh=mesh)
    w = model.layers[0].feed_forward.w1.weight
    assert w.placements == (Replicate(), Shard(0)), w.placements
    assert w.to_local().shape[0] == ARGS.ffn_hidden // 2
    dp_rank = mesh.get_local_rank("replicate") * 2 + mesh.get_local_rank("shard")
    train(model, rank_rows(dp_rank, 4))
    return full_state(model)


def test_hsdp_matches_one_process(run_on_ranks):
    ref = reference_state()
    for state in run_on_ranks(4, _hsdp):
        assert_close_to_reference(state, ref, what="hsdp 2x2")


def _dp_tp() -> dict[str, torch.Tensor]:
    from hyperpar import init_device_mesh, parallelize_module
    from hyperpar.dtensor.placement import Shard

    mesh = init_device_mesh((2, 2), mesh_dim_names=("dp", "tp"))
    model = llama.build(ARGS, seed=0)
    parallelize_module(model, mesh["tp"], plans.tp_plan())
    shard_blocks(model, mesh=mesh["dp"])
    wq = model.layers[0].attention.wq.weight  # colwise: rows split by tp, then by dp
    assert wq.device_mesh.mesh_dim_names == ("tp", "dp")
    assert wq.placements == (Shard(0), Shard(0)), wq.placements
    assert wq.to_local().shape == (ARGS.dim // 4, ARGS.dim)
    wo = model.layers[0].attention.wo.weight  # rowwise: rows by dp, columns by tp (torch's order)
    assert wo.device_mesh.mesh_dim_names == ("dp", "tp")
    assert wo.placements == (Shard(0), Shard(1)), wo.placements
    train(model, rank_rows(mesh.get_local_rank("dp"), 2))
    return full_state(model)


def test_dp_x_tp_matches_one_process_and_full_tensor_is_the_whole_weight(run_on_ranks):
    ref = reference_state()
    for state in run_on_ranks(4, _dp_tp):
        assert_close_to_reference(state, ref, what="dp2 x tp2")
