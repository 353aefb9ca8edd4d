"""``_StridedShard`` imports from hyperpar.dtensor (torchtitan tests for it by isinstance) and is
rejected, with the fix named, wherever hyperpar is asked to lay a tensor out with it."""

import pytest

from hyperpar.dtensor import Shard, _StridedShard
from hyperpar.dtensor.placement import normalize_placements


def test_is_a_placement_but_not_a_plain_shard() -> None:
    p = _StridedShard(0, split_factor=2)
    assert not isinstance(p, Shard) and p.is_shard(0) and p == _StridedShard(0, 2)
    assert repr(p) == "_StridedShard(dim=0, split_factor=2)"


def test_layout_with_it_raises_naming_the_fix() -> None:
    with pytest.raises(NotImplementedError, match="no strided shard.*Shard/Replicate/Partial"):
        normalize_placements([_StridedShard(0, split_factor=2)], 1, 2)
    assert normalize_placements([Shard(-1)], 1, 2) == (Shard(1),)
