"""Placements are small values; uneven shards follow torch.chunk."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hyperpar.dtensor import Partial, Replicate, Shard
from hyperpar.dtensor.placement import chunk_bounds, normalize_placements


def test_placements_are_hashable_values_that_print_as_code():
    assert Shard(1) == Shard(dim=1) and hash(Shard(1)) == hash(Shard(1))
    assert len({Shard(0), Shard(0), Replicate(), Replicate(), Partial(), Partial("sum")}) == 3
    for p in (Shard(dim=2), Replicate(), Partial("max")):
        assert eval(repr(p)) == p
    with pytest.raises(AttributeError):
        Shard(0).dim = 1  # frozen


def test_partial_rejects_unknown_reduce_op_and_lists_the_accepted_ones():
    with pytest.raises(ValueError, match="'sum', 'avg', 'max', 'min'"):
        Partial("mean")


def test_negative_shard_dims_are_normalised_against_the_tensor_rank():
    assert normalize_placements([Shard(-1), Replicate()], 2, 3) == (Shard(2), Replicate())
    with pytest.raises(ValueError, match="out of range"):
        normalize_placements([Shard(3)], 1, 3)
    with pytest.raises(ValueError, match="one placement per mesh dimension"):
        normalize_placements([Shard(0)], 2, 3)


@settings(derandomize=True, max_examples=200, deadline=None)
@given(size=st.integers(0, 40), n=st.integers(1, 8))
def test_chunk_bounds_match_torch_chunk_with_empty_tail_pieces(size, n):
    pieces = torch.arange(size).chunk(n) if size else ()
    for i in range(n):
        off, length = chunk_bounds(size, n, i)
        expected = pieces[i].tolist() if i < len(pieces) else []
        assert list(range(off, off + length)) == expected
