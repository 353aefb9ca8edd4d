"""DTensor redistribution over the backend: ``Partial(op) -> Shard(0)`` (a reduce-scatter) and
``Partial(op) -> Replicate()`` (an all-reduce) give the reduced values for every reduce op."""

from __future__ import annotations

import torch

from hyperpar.platform import get_platform
from hyperpar.testing.conformance.inputs import rank_tensor
from hyperpar.testing.conformance.test_collectives import REDUCERS


def _partial_to_shard_and_replicate() -> list[str]:
    from hyperpar.dtensor import DTensor, Partial, Replicate, Shard, init_device_mesh
    from hyperpar.dtensor.placement import chunk_bounds

    p = get_platform()
    n, r = p.world_size(), p.rank()
    mesh = init_device_mesh((n,))
    rows = 2 * n + 1  # uneven rows (torch.chunk pieces): the last piece is shorter or empty
    wrong = []
    for op in REDUCERS:  # one process start for all ten cases; every case is checked
        full = REDUCERS[op]([rank_tensor(i, (rows, 3), salt=20) for i in range(n)])
        mine = rank_tensor(r, (rows, 3), salt=20).to(p.device())
        for placement, expected in ((Shard(0), full.narrow(0, *chunk_bounds(rows, n, r))),
                                    (Replicate(), full)):
            d = DTensor.from_local(mine, mesh, [Partial(op)])
            out = d.redistribute(mesh, [placement]).to_local().cpu()
            if not torch.allclose(out, expected, rtol=1e-5, atol=1e-5):
                wrong.append(f"Partial({op!r}) -> {placement!r}: got {out.flatten()[:4]}, "
                             f"expected {expected.flatten()[:4]}")
    return wrong


def test_partial_redistribute_reduces_with_its_op(run_on_ranks, world_size):
    """sum, avg, max, min and product, each to Shard(0) and to Replicate()."""
    wrong = run_on_ranks(world_size, _partial_to_shard_and_replicate)
    assert wrong == [[] for _ in range(world_size)], wrong
