"""Vocabulary-parallel cross-entropy equals F.cross_entropy on the gathered logits, forward and
backward, without gathering them."""

import torch
import torch.nn.functional as F

from hyperpar.parallel import vocab_parallel_cross_entropy
from hyperpar.platform import get_platform
from hyperpar.testing import assert_close_to_reference


def _cross_entropy_parity(reduction: str, ignore: bool) -> None:
    platform = get_platform()
    n, rank = platform.world_size(), platform.rank()
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 8 * n, generator=gen) * 3
    target = torch.randint(0, 8 * n, (6,), generator=gen)
    if ignore:
        target[1] = -100
    full = logits.clone().requires_grad_()
    expected = F.cross_entropy(full, target, reduction=reduction)
    expected.sum().backward()

    local = logits.chunk(n, dim=1)[rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, reduction=reduction)
    loss.sum().backward()
    assert_close_to_reference(loss, expected.detach(), what="loss")
    assert_close_to_reference(local.grad, full.grad.chunk(n, dim=1)[rank], what="grad")


def test_vocab_parallel_cross_entropy_matches_full_softmax_mean(run_on_ranks):
    run_on_ranks(2, _cross_entropy_parity, "mean", True)


def test_vocab_parallel_cross_entropy_sum_and_none_on_four_ranks(run_on_ranks):
    run_on_ranks(4, _cross_entropy_parity, "sum", False)
    run_on_ranks(4, _cross_entropy_parity, "none", True)


def _loss_parallel_context_on_dtensor_logits() -> None:
    from torch import nn

    from hyperpar.dtensor import DTensor, Replicate, Shard, init_device_mesh
    from hyperpar.parallel import loss_parallel

    platform = get_platform()
    n, rank = platform.world_size(), platform.rank()
    mesh = init_device_mesh((n,), mesh_dim_names=("tp",))
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(5, 4 * n, generator=gen)
    target = torch.randint(0, 4 * n, (5,), generator=gen)
    target[0] = 7 % (4 * n)
    target[2] = -1
    full = logits.clone().requires_grad_()
    expected = F.cross_entropy(full, target, ignore_index=-1)
    expected.backward()
    local = logits.chunk(n, 1)[rank].clone().requires_grad_()
    dt = DTensor.from_local(local, mesh, [Shard(1)])
    with loss_parallel():
        loss = nn.CrossEntropyLoss(ignore_index=-1)(dt, target)
        plain = F.cross_entropy(logits, target, ignore_index=-1)  # plain tensors pass through
    loss.backward()
    assert isinstance(loss, DTensor) and loss.placements == (Replicate(),), loss  # as torch's
    assert_close_to_reference(loss.full_tensor(), expected.detach(), what="loss")
    assert_close_to_reference(plain, expected.detach(), what="pass-through loss")
    assert_close_to_reference(local.grad, full.grad.chunk(n, 1)[rank], what="grad")


def test_loss_parallel_context_handles_cross_entropy_module_on_sharded_logits(run_on_ranks):
    run_on_ranks(2, _loss_parallel_context_on_dtensor_logits)
