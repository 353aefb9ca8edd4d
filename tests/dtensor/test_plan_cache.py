"""The redistribution plan cache: keyed on what a plan depends on, and bounded."""

import torch


def _many_sequence_lengths():
    from hyperpar.dtensor import DTensor, Partial, Replicate, Shard, init_device_mesh
    from hyperpar.dtensor import redistribute as rd

    mesh = init_device_mesh((2,))
    rd._cached_plan.cache_clear()
    # A training loop over 2000 sequence lengths: the plan does not depend on the length.
    for length in range(1, 2001):
        rd.plan_redistribute(mesh, (Shard(1),), (Replicate(),), (4, length, 8))
        rd.plan_redistribute(mesh, (Partial(),), (Shard(0),), (4, length, 8))
    info = rd.plan_cache_info()
    # ... and the cached plans still give the right values for lengths of either parity.
    values = []
    for length in (3, 4, 7):
        full = torch.arange(4 * length, dtype=torch.float32).view(4, length)
        d = DTensor.from_local(full.chunk(2, dim=1)[mesh.get_local_rank()], mesh, [Shard(1)],
                              shape=full.shape)
        values.append(torch.equal(d.redistribute(mesh, [Replicate()]).to_local(), full))
    return info.currsize, info.maxsize, info.hits, values


def test_plan_cache_ignores_tensor_shape_and_is_bounded(run_on_ranks):
    size, maxsize, hits, values = run_on_ranks(2, _many_sequence_lengths)[0]
    assert size == 2, f"one plan per (mesh shape, src, dst), got {size} entries"
    assert hits == 2 * 2000 - 2
    assert maxsize is not None and maxsize <= 4096
    assert values == [True, True, True]


def _eviction():
    from hyperpar.dtensor import Shard, init_device_mesh
    from hyperpar.dtensor import redistribute as rd

    mesh = init_device_mesh((1,))
    rd._cached_plan.cache_clear()
    # More distinct (src, dst) pairs than the cache holds: the oldest are evicted.
    for d in range(rd.PLAN_CACHE_SIZE + 10):
        rd.plan_redistribute(mesh, (Shard(d),), (Shard(d + 1),))
    return rd.plan_cache_info().currsize, rd.PLAN_CACHE_SIZE


def test_plan_cache_evicts_beyond_its_bound(run_on_ranks):
    size, bound = run_on_ranks(1, _eviction)[0]
    assert size == bound
