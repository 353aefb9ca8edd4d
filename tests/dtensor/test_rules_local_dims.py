"""The neutral ``local_dims`` and ``gathered`` rules (no framework, no ranks): which shards
they keep, gather, and what they answer for Partial inputs."""

import pytest

from hyperpar.dtensor.placement import Partial, Replicate, Shard
from hyperpar.dtensor.rules import TensorMeta, propagate

R, P = Replicate(), Partial()


def test_local_dims_keeps_shards_on_dims_the_op_does_not_read():
    r = propagate("local_dims", (TensorMeta((Shard(0), Shard(2)), (4, 5, 6)),), (2, 2),
                  dims=(-2, -1))
    assert r.inputs == ((Shard(0), R),) and r.outputs == ((Shard(0), R),)
    assert r.shapes == ((4, 5, 6),)


def test_local_dims_reduces_a_partial_and_gives_each_output_the_input_shape():
    r = propagate("local_dims", (TensorMeta((P,), (4, 5)),), (2,), dims=(1,), n_out=2)
    assert r.inputs == ((R,),) and r.outputs == ((R,), (R,)) and r.shapes == ((4, 5),) * 2


def test_local_dims_rejects_a_dim_out_of_range():
    with pytest.raises(IndexError, match="out of range"):
        propagate("local_dims", (TensorMeta((Shard(0),), (4, 5)),), (2,), dims=(2,))


def test_gathered_replicates_every_input_and_output():
    r = propagate("gathered", (TensorMeta((Shard(0),), (4, 5)), TensorMeta((P,), (5,))), (2,),
                  shapes=((4,), ()))
    assert r.inputs == ((R,), (R,)) and r.outputs == ((R,), (R,))
    assert r.shapes == ((4,), ()) and r.grad_sum == ((), ())


def test_local_dims_takes_output_shapes_that_resize_only_the_dims_it_reads():
    # pooling (N, C, H, W) -> (N, C, H/2, W/2): the batch shard stays
    r = propagate("local_dims", (TensorMeta((Shard(0),), (4, 3, 6, 6)),), (2,), dims=(-2, -1),
                  n_out=2, shapes=((4, 3, 3, 3), (4, 3, 3, 3)))
    assert r.inputs == ((Shard(0),),) and r.outputs == ((Shard(0),),) * 2
    assert r.shapes == ((4, 3, 3, 3),) * 2


def test_local_dims_refuses_an_output_shape_that_resizes_a_kept_shard():
    with pytest.raises(ValueError, match="resizes sharded dim 0"):
        propagate("local_dims", (TensorMeta((Shard(0),), (4, 3)),), (2,), dims=(1,),
                  shapes=((2, 3),))
