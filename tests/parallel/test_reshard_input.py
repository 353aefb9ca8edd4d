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


def _both(where="call", checkpoint=None):
    """Keep-gathered then shard-saving, in the same processes."""
    return _run_block(False, where, checkpoint), _run_block(True, where, checkpoint)


def _same(a, b):
    assert torch.equal(a[1], b[1]), "outputs differ"
    assert torch.equal(a[2], b[2]), "input gradients differ"
    for name in a[3]:
        assert torch.equal(a[3][name], b[3][name]), f"{name}.grad differs"


@pytest.mark.parametrize("world", [2, 4])
def test_reshard_is_bit_identical_and_saves_the_shard(world):
    for r, (keep, shard) in enumerate(run_distributed(_both, world)):
        _same(keep, shard)
        # each of the block's two gathered inputs (attention's, the MLP's: b*s*dim fp32
        # elements gathered) is kept as its 1/world shard instead: exactly this many bytes
        from tests.parallel._sp_layer import ARGS

        gathered = B * S * ARGS.dim * 4
        assert keep[0] - shard[0] == 2 * (gathered - gathered // world), r


def _per_style_and_per_call():
    return _run_block(True, "call"), _run_block(True, "style")


def test_switch_per_style_equals_per_call():
    for call, style in run_distributed(_per_style_and_per_call, 2):
        _same(call, style)
        assert call[0] == style[0]


def test_qkv_gather_once_forward_and_once_backward():
    for keep, shard in run_distributed(_both, 2):
        # forward: one all-gather per gathered input (attention's, the MLP's), shared by
        # q/k/v and w1/w3, on both paths
        assert shard[4] == keep[4] == 2
        # backward: one more all-gather per gathered input (not one per consumer)
        assert shard[5] - keep[5] == 2


@pytest.mark.parametrize("mode", ["non_reentrant", "reentrant"])
def test_under_checkpoint_no_second_regather(mode):
    """Activation checkpointing frees the region and recomputes it (gathering again) itself:
    the switch then changes nothing -- same values, same collectives, no extra gather."""
    for keep, shard in run_distributed(_both, 2, "call", mode):
        _same(keep, shard)
        assert (shard[4], shard[5]) == (keep[4], keep[5])
