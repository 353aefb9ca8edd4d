"""fully_shard trains the example Llama model exactly like one process on the full batch
(AdamW, float32, rtol = atol = 1e-5), while each rank holds only its dim-0 shard of every
parameter, gradient and optimizer state."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hyperpar.testing.parity import assert_close_to_reference

from ._common import (
    ARGS,
    BATCH,
    full_state,
    llama,
    rank_rows,
    reference_state,
    shard_blocks,
    train,
)

UNEVEN = llama.ModelArgs(vocab_size=67, dim=40, n_layers=2, n_heads=4, ffn_hidden=70,
                         max_seq_len=16)


def _fsdp_train(args=ARGS, accumulate: int = 1, prefetch: bool = True,
                reshard_after_forward: bool = True) -> dict[str, torch.Tensor]:
    from hyperpar.platform import get_platform

    pf = get_platform()
    model = shard_blocks(llama.build(args, seed=0),
                         reshard_after_forward=reshard_after_forward)
    if not prefetch:
        model.set_implicit_prefetch(False)

    def sync(m, last):
        m.set_requires_gradient_sync(last)

    train(model, rank_rows(pf.rank(), pf.world_size()), args=args, accumulate=accumulate,
          sync=sync if accumulate > 1 else None)
    return full_state(model)


def _assert_trained(results, ref, what):
    init = full_state(llama.build(ARGS, seed=0))
    moved = max(float((ref[k] - init[k]).abs().max()) for k in init if k in ref)
    assert moved > 1e-3, "the reference did not train: the parity check would be vacuous"
    for state in results:
        assert_close_to_reference(state, ref, what=what)


@pytest.mark.parametrize("world", [2, 4])
def test_fully_shard_llama_matches_one_process_through_adamw_steps(run_on_ranks, world):
    _assert_trained(run_on_ranks(world, _fsdp_train), reference_state(), f"fsdp{world}")


def test_without_prefetch_or_reshard_the_result_is_the_same(run_on_ranks):
    ref = reference_state()
    _assert_trained(run_on_ranks(2, _fsdp_train, prefetch=False), ref, "no prefetch")
    _assert_trained(run_on_ranks(2, _fsdp_train, reshard_after_forward=False), ref,
                    "reshard_after_forward=False")


def test_gradient_accumulation_without_sync_equals_the_full_batch(run_on_ranks):
    results = run_on_ranks(2, _fsdp_train, accumulate=2)
    _assert_trained(results, reference_state(accumulate=2), "accumulate=2")


def _uneven_grads_then_step() -> tuple[float, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One backward on this rank's rows, then one AdamW step on the uneven shards: the loss,
    the gathered gradients (before the step) and the gathered parameters after it."""
    from hyperpar.platform import get_platform

    from ._common import LR, loss_of

    pf = get_platform()
    model = shard_blocks(llama.build(UNEVEN, seed=0))
    tokens, labels = llama.batch(UNEVEN, batch_size=BATCH, seed=0)
    rows = rank_rows(pf.rank(), pf.world_size())
    loss = loss_of(model, tokens[rows], labels[rows])
    loss.backward()
    grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
    torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1).step()
    return loss.item(), grads, full_state(model)


def test_uneven_shards_match_one_process(run_on_ranks):
    """67 vocab rows and 70 hidden rows over 4 ranks: shards of 17/17/17/16 and 18/18/18/16.

    Compared where the arithmetic is deterministic (AdamW steps amplify rounding in the
    smallest gradients, so trained weights are not): the averaged gradients against one process
    on the full batch, within float32 summation error (the ranks sum the batch in another
    order): rtol 1e-4, atol 1e-5 x the tensor's largest gradient; then the step on uneven
    shards against torch's AdamW applied to the same gradients on the full tensors, which is
    elementwise, so equal up to a few ulps."""
    from ._common import LR, loss_of

    results = run_on_ranks(4, _uneven_grads_then_step)
    ref = llama.build(UNEVEN, seed=0)
    tokens, labels = llama.batch(UNEVEN, batch_size=BATCH, seed=0)
    with torch.no_grad():
        ref_losses = [float(loss_of(ref, tokens[rank_rows(r, 4)], labels[rank_rows(r, 4)]))
                      for r in range(4)]
    loss_of(ref, tokens, labels).backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    for rank, (loss, grads, _) in enumerate(results):
        assert abs(loss - ref_losses[rank]) <= 1e-5 * abs(ref_losses[rank]), (rank, loss)
        assert set(grads) == set(ref_grads)
        for name, g in grads.items():
            scale = float(ref_grads[name].abs().max())
            assert scale > 0, f"{name}: no gradient in the reference"
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-5 * scale,
                                       msg=lambda m, n=name: f"uneven fsdp4 grad {n}: {m}")
    # The optimizer step on uneven shards, fed the gradients fsdp reduced.
    for name, p in ref.named_parameters():
        p.grad = results[0][1][name].clone()
    torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.1).step()
    stepped = full_state(ref)
    moved = max(float((stepped[k] - v).abs().max())
                for k, v in full_state(llama.build(UNEVEN, seed=0)).items())
    assert moved > 1e-3, "the step did not move the weights: the check would be vacuous"
    for _, _, state in results:
        assert_close_to_reference(state, stepped, rtol=1e-6, atol=1e-7,
                                  what="uneven fsdp4 after one AdamW step")


def _fewer_rows_than_ranks() -> tuple[list[int], dict[str, torch.Tensor]]:
    from hyperpar import fully_shard
    from hyperpar.platform import get_platform

    pf = get_platform()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 3), nn.Tanh(), nn.Linear(3, 2))
    fully_shard(model)
    rows = [p.to_local().shape[0] for p in model.parameters()]
    x = torch.randn(8, 5, generator=torch.Generator().manual_seed(1))
    part = x[pf.rank() * 2:(pf.rank() + 1) * 2]
    model(part).square().mean().backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    return rows, grads


def test_a_rank_may_hold_no_rows(run_on_ranks):
    results = run_on_ranks(4, _fewer_rows_than_ranks)
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(5, 3), nn.Tanh(), nn.Linear(3, 2))
    x = torch.randn(8, 5, generator=torch.Generator().manual_seed(1))
    ref(x).square().mean().backward()
    want = {n: p.grad for n, p in ref.named_parameters()}
    # weights/biases of 3 and 2 rows in chunks of 1: rank 3 holds no row of any of them
    assert [rows for rows, _ in results] == [[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0],
                                             [0, 0, 0, 0]]
    for _, grads in results:
        assert_close_to_reference(grads, want, what="grads with an empty shard")


def _local_bytes() -> tuple[int, int, int, int]:
    from hyperpar.platform import get_platform

    pf = get_platform()
    model = shard_blocks(llama.build(ARGS, seed=0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens, labels = llama.batch(ARGS, batch_size=BATCH, seed=0)
    rows = rank_rows(pf.rank(), pf.world_size())
    from ._common import loss_of

    loss_of(model, tokens[rows], labels[rows]).backward()
    opt.step()

    def nbytes(t):
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    params = sum(nbytes(p) for p in model.parameters())
    grads = sum(nbytes(p.grad) for p in model.parameters())
    states = sum(nbytes(v) for s in opt.state.values() for v in s.values()
                 if torch.is_tensor(v) and v.ndim > 0)
    unsharded_alive = sum(
        p.unsharded.untyped_storage().size() for m in model.modules()
        if hasattr(m, "_fsdp_group") for p in m._fsdp_group.params if p.unsharded is not None)
    return params, grads, states, unsharded_alive


def test_each_rank_holds_a_quarter_of_params_grads_and_optimizer_states(run_on_ranks):
    full = sum(p.numel() * 4 for p in llama.build(ARGS, seed=0).parameters())
    for params, grads, states, alive in run_on_ranks(4, _local_bytes):
        assert params == full // 4 and grads == full // 4  # tiny's dims all divide by 4
        assert states == 2 * full // 4  # AdamW: exp_avg and exp_avg_sq
        assert alive == 0, "unsharded parameters were left allocated after the step"
