"""In-place ops through views of a DTensor: where the view is a view of the local shard the
write reaches the DTensor (as in torch, checked against torch's own DTensor on the same script);
where making it gathered a sharded dim it is a copy, and an in-place op raises on every rank
instead of being silently dropped (torch's DTensor drops it)."""

from __future__ import annotations

import pytest
import torch

WRITE_THROUGH = [("R", "x[0].add_(1)"), ("R", "x[:, 1].mul_(0)"), ("S0", "x[:, 1].mul_(0)"),
                 ("S1", "x[0].add_(1)"), ("S0", "x.view(-1).zero_()"), ("S0", "x.t().add_(1)"),
                 ("R", "x.view(-1)[0].fill_(5)"), ("S1", "x.T.add_(1)")]
GATHERED = [("S0", "x[0].add_(1)", "x[0]"), ("S1", "x[:, 1].mul_(0)", "x[:, 1]"),
            ("S0", "x[1:3].fill_(7)", "x[1:3]"), ("S0", "x[0, 1:3].add_(1)", "x[0, 1:3]"),
            ("S0", "x[0][1:3].zero_()", "x[0]"), ("S0", "y = x[0]; y += 1", "x[0]")]


def _apply(lib: str, cases: list) -> list:
    if lib == "torch":
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh
        mesh = init_device_mesh("cpu", (2,))
    else:
        from hyperpar.dtensor import Replicate, Shard, distribute_tensor, init_device_mesh
        mesh = init_device_mesh((2,))
    placements = {"R": Replicate(), "S0": Shard(0), "S1": Shard(1)}
    out = []
    for case in cases:
        x = distribute_tensor(torch.arange(16.0).reshape(4, 4), mesh, [placements[case[0]]])
        try:
            exec(case[1], {"x": x})
        except Exception as exc:
            out.append(f"{type(exc).__name__}: {exc}")
            continue
        out.append(x.full_tensor())
    return out


def _expected(expr: str) -> torch.Tensor:
    x = torch.arange(16.0).reshape(4, 4)
    exec(expr, {"x": x})
    return x


def test_writes_through_views_of_the_local_shard_as_torch_does(run_on_ranks):
    ours = run_on_ranks(2, _apply, "hyperpar", WRITE_THROUGH)
    theirs = run_on_ranks(2, _apply, "torch", WRITE_THROUGH)
    for rank in range(2):
        for (placement, expr), got, torch_got in zip(WRITE_THROUGH, ours[rank], theirs[rank],
                                                     strict=True):
            want = _expected(expr)
            assert torch.equal(torch_got, want), (placement, expr)
            assert isinstance(got, torch.Tensor), (placement, expr, got)
            assert torch.equal(got, want), (placement, expr)


@pytest.mark.parametrize("placement, expr, what", GATHERED, ids=[c[1] for c in GATHERED])
def test_an_in_place_op_on_a_gathered_copy_raises_on_every_rank(run_on_ranks, placement, expr,
                                                                  what):
    dim = placement[1]
    for message, in run_on_ranks(2, _apply, "hyperpar", [(placement, expr)]):
        assert message.startswith("InplaceOnCopyError: in-place "), message
        assert f"on {what} of a DTensor sharded on dim {dim}" in message, message
        assert "gathered copy, not a view" in message


def _out_of_place_and_metadata_stay_allowed() -> list:
    from hyperpar.dtensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh((2,))
    x = distribute_tensor(torch.arange(16.0).reshape(4, 4), mesh, [Shard(0)])
    row = x[0]
    row.requires_grad_()
    return [(row + 1).full_tensor(), row.requires_grad]


def test_out_of_place_ops_and_requires_grad_on_a_gathered_copy_still_work(run_on_ranks):
    for plus_one, requires_grad in run_on_ranks(2, _out_of_place_and_metadata_stay_allowed):
        assert torch.equal(plus_one, torch.arange(4.0) + 1)
        assert requires_grad
