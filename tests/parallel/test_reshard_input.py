"""A column-parallel linear fed an all-gathered (sequence-sharded) input that saves only the
shard and all-gathers it again in backward (``reshard_input_after_forward=True``, Megatron's
sequence parallelism) against the same plan keeping the gathered input (torch's behaviour).

The two paths run the same kernels in the same order on the same values -- the saved tensor
is swapped for a handle and gathered back bit for bit -- so outputs and gradients are compared
with ``torch.equal``, not a tolerance. Saved activations are counted exactly (bytes of the
distinct storages autograd saves, parameters excluded: ``SavedBytes``), not timed. Each case
runs on real gloo ranks (2 and 4)."""

from __future__ import annotations

import pytest
import torch

from hyperpar.testing.harness import run_distributed

B, S = 2, 8  # batch, sequence (divisible by 2 and 4)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _run_block(reshard, where="call", checkpoint=None):
    """One TP+SP Llama block, forward + backward: (saved bytes, output, input grad, grads,
    all-gathers in forward, all-gathers in backward)."""
    from hyperpar import init_device_mesh, parallelize_module
    from hyperpar.platform import get_platform
    from hyperpar.torch.parallel.memory import SavedBytes
    from tests.parallel._sp_layer import block, block_plan, inputs, rope

    p = get_platform()
    rank, world = p.rank(), p.world_size()
    mesh = init_device_mesh((world,), mesh_dim_names=("tp",))
    model = block()
    plan = block_plan()
    if where == "style":
        for k in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1",
                  "feed_forward.w3"):
            plan[k] = type(plan[k])(reshard_input_after_forward=reshard)
        parallelize_module(model, mesh, plan)
    else:
        parallelize_module(model, mesh, plan, reshard_input_after_forward=reshard)
    x = inputs(B, S, rank, world)
    cos, sin = rope(S)
    gathers = {"n": 0}
    real = type(p).all_gather_into_tensor

    def counting(self, *a, **k):  # count the all-gathers of activations (not the length ones)
        gathers["n"] += 1
        return real(self, *a, **k)

    params = [_local(q) for q in model.parameters()]
    type(p).all_gather_into_tensor = counting
    try:
        with SavedBytes(exclude=params) as saved:
            if checkpoint is None:
                y = model(x, cos, sin)
            else:
                from torch.utils.checkpoint import checkpoint as ckpt

                y = ckpt(model, x, cos, sin, use_reentrant=checkpoint == "reentrant")
        fwd = gathers["n"]
        (_local(y) * torch.arange(_local(y).numel()).view_as(_local(y)).sin()).sum().backward()
        bwd = gathers["n"] - fwd
    finally:
        type(p).all_gather_into_tensor = real
    grads = {n: _local(q.grad).clone() for n, q in model.named_parameters()}
    return saved.nbytes, _local(y).detach().clone(), x.grad.clone(), grads, fwd, bwd


def _same(a, b):
    assert torch.equal(a[1], b[1]), "outputs differ"
    assert torch.equal(a[2], b[2]), "input gradients differ"
    for name in a[3]:
        assert torch.equal(a[3][name], b[3][name]), f"{name}.grad differs"


@pytest.mark.parametrize("world", [2, 4])
def test_reshard_is_bit_identical_and_saves_the_shard(world):
    keep = run_distributed(_run_block, world, False)
    shard = run_distributed(_run_block, world, True)
    for r in range(world):
        _same(keep[r], shard[r])
        # each of the block's two gathered inputs (attention's, the MLP's: b*s*dim fp32
        # elements gathered) is kept as its 1/world shard instead: exactly this many bytes
        from tests.parallel._sp_layer import ARGS

        gathered = B * S * ARGS.dim * 4
        assert keep[r][0] - shard[r][0] == 2 * (gathered - gathered // world)


def test_switch_per_style_equals_per_call():
    call = run_distributed(_run_block, 2, True, "call")
    style = run_distributed(_run_block, 2, True, "style")
    for r in range(2):
        _same(call[r], style[r])
        assert call[r][0] == style[r][0]


def test_qkv_gather_once_forward_and_once_backward():
    keep = run_distributed(_run_block, 2, False)
    shard = run_distributed(_run_block, 2, True)
    for r in range(2):
        # forward: one all-gather per gathered input (attention's, the MLP's), shared by
        # q/k/v and w1/w3, on both paths
        assert shard[r][4] == keep[r][4] == 2
        # backward: one more all-gather per gathered input (not one per consumer)
        assert shard[r][5] - keep[r][5] == 2


@pytest.mark.parametrize("mode", ["non_reentrant", "reentrant"])
def test_under_checkpoint_no_second_regather(mode):
    """Activation checkpointing frees the region and recomputes it (gathering again) itself:
    the switch then changes nothing -- same values, same collectives, no extra gather."""
    keep = run_distributed(_run_block, 2, False, "call", mode)
    shard = run_distributed(_run_block, 2, True, "call", mode)
    for r in range(2):
        _same(keep[r], shard[r])
        assert (shard[r][4], shard[r][5]) == (keep[r][4], keep[r][5])
