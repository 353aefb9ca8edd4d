"""A global shape inferred from even shards (``from_local(run_check=False)`` without
``shape=``) that the ranks' pieces contradict raises on every rank at the first gather, instead
of a gloo abort on one rank and a wrong global shape on the other. (``SequenceParallel`` on an
odd sequence: tests/parallel/test_debug_input_checks.py.)"""

from __future__ import annotations

import torch


def _from_local_uneven() -> str:
    from hyperpar.dtensor import DTensor, Shard, init_device_mesh

    mesh = init_device_mesh((2,))
    rank = mesh.get_local_rank()
    x = DTensor.from_local(torch.ones(3 - rank, 2), mesh, [Shard(0)], run_check=False)
    try:
        x.full_tensor()
    except ValueError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_from_local_with_uneven_pieces_and_no_shape_raises_on_every_rank(run_on_ranks):
    for message in run_on_ranks(2, _from_local_uneven):
        assert message.startswith("UnevenShardsError: DTensor.from_local(run_check=False) "
                                  "without shape="), message
        assert "rank 0 holds 3, rank 1 holds 2" in message and "shape=" in message


def _from_local_even() -> list:
    from hyperpar.dtensor import DTensor, Shard, init_device_mesh

    mesh = init_device_mesh((2,))
    rank = mesh.get_local_rank()
    local = torch.arange(4.0).reshape(2, 2) + 4 * rank
    x = DTensor.from_local(local.clone().requires_grad_(), mesh, [Shard(0)], run_check=False)
    full = x.full_tensor()
    full.pow(2).sum().backward()
    y = DTensor.from_local(local.clone(), mesh, [Shard(0)], run_check=False)
    return [full.detach(), x.to_local().grad, y.redistribute(mesh, [Shard(1)]).full_tensor()]


def test_from_local_with_even_pieces_still_gathers_and_differentiates(run_on_ranks):
    whole = torch.cat([torch.arange(4.0).reshape(2, 2), torch.arange(4.0).reshape(2, 2) + 4])
    for rank, (full, grad, again) in enumerate(run_on_ranks(2, _from_local_even)):
        assert torch.equal(full, whole)
        assert torch.equal(again, whole)
        assert torch.equal(grad, 2 * whole[2 * rank:2 * rank + 2])
