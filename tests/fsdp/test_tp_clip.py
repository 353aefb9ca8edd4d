"""fully_shard x tensor parallelism as torchtitan writes it: torch's own ``clip_grad_norm_`` over
every parameter (colwise and rowwise), also when the TP and dp meshes come from two different
root meshes over the same ranks. Compared with the same model trained in one plain-torch
process on the whole batch (tolerance: fp32 sums of at most 16 products reduced in another
order, ~1e-6; 1e-5 leaves margin and fails on any wrong step, which moves weights by ~1e-2)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

STEPS, ROWS, TOL = 3, 8, 1e-5


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))


def _batch(step: int) -> torch.Tensor:
    return torch.randn(ROWS, 8, generator=torch.Generator().manual_seed(step))


def _train(model: nn.Module, rows: slice) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    norms = []
    for step in range(STEPS):
        opt.zero_grad()
        model(_batch(step)[rows]).pow(2).mean().backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        opt.step()
    return norms


def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    ref = _net()
    norms = _train(ref, slice(None))
    return norms, {k: v.detach() for k, v in ref.named_parameters()}


def _fsdp_tp(shape: tuple[int, int], two_roots: bool) -> dict:
    from hyperpar import (
        ColwiseParallel,
        RowwiseParallel,
        fully_shard,
        init_device_mesh,
        parallelize_module,
    )

    mesh = init_device_mesh(shape, mesh_dim_names=("dp", "tp"))
    tp_mesh, dp_mesh = mesh["tp"], mesh["dp"]
    if two_roots:  # a second view of the same ranks, as two unflattenings of the world give
        other = init_device_mesh(shape, mesh_dim_names=("fsdp", "tp_other"))
        dp_mesh = other["fsdp"]
    model = _net()
    parallelize_module(model, tp_mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=dp_mesh)
    meshes = {k: (p.device_mesh.mesh_dim_names, p.device_mesh.size(), tuple(p.to_local().shape))
              for k, p in model.named_parameters()}
    per = ROWS // dp_mesh.size()
    rows = slice(dp_mesh.get_local_rank() * per, (dp_mesh.get_local_rank() + 1) * per)
    norms = _train(model, rows)
    return {"norms": norms, "meshes": meshes,
            "params": {k: p.full_tensor().detach() for k, p in model.named_parameters()}}


@pytest.mark.parametrize(("n", "shape", "two_roots"), [
    (2, (1, 2), False), (4, (2, 2), False), (4, (2, 2), True)])
def test_clip_grad_norm_under_fully_shard_x_tp_matches_one_process(
        run_on_ranks, n, shape, two_roots):
    ref_norms, ref = _reference()
    dp, tp = shape
    for res in run_on_ranks(n, _fsdp_tp, shape, two_roots):
        torch.testing.assert_close(res["norms"], ref_norms, atol=TOL, rtol=TOL)
        for k, want in ref.items():
            torch.testing.assert_close(res["params"][k], want, atol=TOL, rtol=TOL, msg=k)
        # every parameter on one mesh of all dp x tp ranks; the rowwise weight in torch's
        # order (dp first), its local shard as torch's: rows by dp, columns by tp
        assert {size for _, size, _ in res["meshes"].values()} == {n}
        names, _, local = res["meshes"]["2.weight"]
        assert names == (("fsdp", "tp") if two_roots else ("dp", "tp"))
        assert local == (8 // dp, 16 // tp)
        assert res["meshes"]["0.weight"][2] == (16 // tp // dp, 8)


def _tiles_nothing() -> str:
    from hyperpar import ColwiseParallel, fully_shard, init_device_mesh, parallelize_module

    mesh = init_device_mesh((2, 2), mesh_dim_names=("dp", "tp"))
    same_as_tp = init_device_mesh((2, 2), mesh_dim_names=("x", "y"))["y"]
    model = _net()
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel()})
    try:
        fully_shard(model, mesh=same_as_tp)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_dp_mesh_over_the_tp_ranks_is_refused_on_every_rank(run_on_ranks):
    for msg in run_on_ranks(4, _tiles_nothing):
        assert "not a slice of the same named mesh" in msg, msg


def _transposed_meshes() -> dict:
    from hyperpar import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh((2, 2), mesh_dim_names=("dp", "tp"))
    flipped = mesh["tp", "dp"]  # the same four ranks, dims in the other order
    x = torch.arange(32.0).reshape(8, 4)
    a = distribute_tensor(x, mesh, [Shard(0), Shard(1)])
    b = distribute_tensor(2 * x, flipped, [Shard(1), Shard(0)])  # the same split of x
    nested_tp_first = distribute_tensor(x, flipped, [Shard(0), Shard(0)])
    nested_dp_first = distribute_tensor(x, mesh, [Shard(0), Shard(0)])
    try:
        nested_tp_first + nested_dp_first  # rows split in another order: no common mesh
        refused = "no error"
    except ValueError as exc:
        refused = str(exc)
    return {"sum": (a + b).full_tensor(),
            "stacked": torch.stack([a.sum(), nested_tp_first.pow(2).sum()]).full_tensor(),
            "refused": refused}


def test_dtensors_on_transposed_meshes_of_the_same_ranks_meet_in_one_op(run_on_ranks):
    x = torch.arange(32.0).reshape(8, 4)
    for res in run_on_ranks(4, _transposed_meshes):
        torch.testing.assert_close(res["sum"], 3 * x)  # exact: small integers
        torch.testing.assert_close(res["stacked"], torch.stack([x.sum(), x.pow(2).sum()]))
        assert "different meshes" in res["refused"], res["refused"]
