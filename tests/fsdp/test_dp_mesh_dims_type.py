"""``hyperpar.fsdp.DataParallelMeshDims`` against torch FSDP2's type of the same name."""

import pytest

from hyperpar.fsdp import DataParallelMeshDims

torch_fsdp = pytest.importorskip("torch.distributed.fsdp")


@pytest.mark.parametrize("kwargs", [{"shard": "fsdp"}, {"shard": ("dp_shard", "cp")},
                                    {"replicate": "dp_replicate", "shard": "fsdp"}])
def test_names_as_torch(kwargs: dict) -> None:
    ours = DataParallelMeshDims(**kwargs)
    if not hasattr(torch_fsdp, "DataParallelMeshDims"):
        pytest.skip("this torch has no DataParallelMeshDims")
    theirs = torch_fsdp.DataParallelMeshDims(**kwargs)
    assert (ours.shard_names, ours.replicate_names) == (theirs.shard_names,
                                                        theirs.replicate_names)


def test_neither_dim_raises() -> None:
    with pytest.raises(ValueError, match="At least one of shard or replicate"):
        DataParallelMeshDims()
