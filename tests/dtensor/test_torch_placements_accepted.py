"""Placements made by torch (``torch.distributed.tensor.Shard`` etc., as libraries written for
torch's DTensor produce them) are taken as hyperpar's own wherever hyperpar takes placements."""

import pytest

pytest.importorskip("torch.distributed.tensor")

from torch.distributed.tensor import Partial as TPartial  # noqa: E402
from torch.distributed.tensor import Replicate as TReplicate  # noqa: E402
from torch.distributed.tensor import Shard as TShard  # noqa: E402

from hyperpar.dtensor import Partial, Replicate, Shard  # noqa: E402
from hyperpar.dtensor.placement import normalize_placements  # noqa: E402


def test_torch_placements_become_hyperpar_ones() -> None:
    got = normalize_placements([TShard(-1), TReplicate(), TPartial("avg")], 3, 2)
    assert got == (Shard(1), Replicate(), Partial("avg"))
    assert all(type(p) in (Shard, Replicate, Partial) for p in got)


def test_equal_to_torch_placements_of_the_same_layout() -> None:
    ours = (Shard(0), Replicate(), Partial("sum"))
    assert ours == (TShard(0), TReplicate(), TPartial("sum"))
    assert ours != (TShard(1), TReplicate(), TPartial("sum"))
    assert Partial("sum") != TPartial("avg") and Replicate() != TShard(0)
    assert len({Shard(0), Shard(0), Replicate()}) == 2


def test_isinstance_of_torch_placements_under_hyperpar_names() -> None:
    # torchtitan (imports rewritten) tests spmd_types' torch placements with hyperpar's names
    assert isinstance(TShard(-1), Shard) and isinstance(TReplicate(), Replicate)
    assert isinstance(TPartial("avg"), Partial)
    assert not isinstance(TShard(0), Replicate) and not isinstance(TReplicate(), Shard)
    assert not isinstance(Replicate(), Shard) and isinstance(Shard(1), Shard)
    from hyperpar.dtensor.placement import Placement
    assert not isinstance(TShard(0), Placement)  # still converted where hyperpar takes one


def test_torch_strided_shard_is_rejected_naming_the_fix() -> None:
    from torch.distributed.tensor.placement_types import _StridedShard

    with pytest.raises(NotImplementedError, match="no strided shard"):
        normalize_placements([_StridedShard(0, split_factor=2)], 1, 2)


def _facts():
    import torch

    from hyperpar.dtensor import distribute_tensor, init_device_mesh

    mesh = init_device_mesh((2,))
    full = torch.arange(8.0).reshape(4, 2)
    d = distribute_tensor(full, mesh, [TShard(0)])
    return {"local": d.to_local(), "placements": tuple(d.placements),
            "back": d.redistribute(mesh, [TReplicate()]).to_local()}


def test_distribute_tensor_with_torch_placements(run_on_ranks):
    import torch

    full = torch.arange(8.0).reshape(4, 2)
    for rank, f in enumerate(run_on_ranks(2, _facts)):
        assert f["placements"] == (Shard(0),)
        assert torch.equal(f["local"], full[2 * rank:2 * rank + 2])
        assert torch.equal(f["back"], full)
