"""fully_shard policies and utilities: bf16 mixed precision against a bf16 one-process reference,
meta-device init materialising only shards, clip_grad_norm_ equal to one process's norm,
unshard()/reshard(), and the errors a user sees."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from hyperpar.testing.parity import assert_close_to_reference

from ._common import ARGS, BATCH, llama, loss_of, rank_rows, shard_blocks, train

# bf16 keeps 8 bits of mantissa (eps 2**-8 = 3.9e-3): two ranks' bf16 gradients averaged in bf16
# differ from one process's bf16 gradients by a few ulps. Compared: each gradient tensor of
# every step, relative Frobenius error (elementwise checks would flag AdamW's sign flips of
# near-zero gradients, which are not errors), and the losses.
BF16_REL = 2e-2


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def _bf16_reference(steps: int = 3) -> tuple[list[dict[str, torch.Tensor]], list[float]]:
    """FSDP2's mixed precision in one process: fp32 master weights, a bf16 copy computes the
    forward and backward, its gradients (cast to fp32) step the master weights."""
    master = llama.build(ARGS, seed=0)
    opt = torch.optim.AdamW(master.parameters(), lr=1e-2, weight_decay=0.1)
    grads, losses = [], []
    for step in range(steps):
        tokens, labels = llama.batch(ARGS, batch_size=BATCH, seed=step)
        work = copy.deepcopy(master).to(torch.bfloat16)
        loss = loss_of(work, tokens, labels)
        loss.backward()
        losses.append(loss.item())
        for p, q in zip(master.parameters(), work.parameters(), strict=True):
            p.grad = q.grad.float()
        grads.append({n: p.grad.clone() for n, p in master.named_parameters()})
        opt.step()
        opt.zero_grad()
    return grads, losses


def _fsdp_bf16() -> tuple[list[dict[str, torch.Tensor]], list[float], set, set]:
    from hyperpar import MixedPrecisionPolicy
    from hyperpar.platform import get_platform

    pf = get_platform()
    model = shard_blocks(llama.build(ARGS, seed=0),
                         mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    seen: set = set()
    model.layers[0].attention.wq.register_forward_hook(
        lambda m, a, o: seen.add((m.weight.dtype, type(m.weight).__name__, o.dtype)))
    grads: list[dict[str, torch.Tensor]] = []
    losses = train(model, rank_rows(pf.rank(), pf.world_size()), before_step=lambda m: grads.append(
        {n: p.grad.full_tensor() for n, p in m.named_parameters()}))
    sharded = {(p.dtype, type(p).__name__) for p in model.parameters()}
    return grads, losses, seen, sharded


def test_bf16_mixed_precision_matches_a_bf16_reference(run_on_ranks):
    ref_grads, ref_losses = _bf16_reference()
    fp32 = llama.build(ARGS, seed=0)
    tokens, labels = llama.batch(ARGS, batch_size=BATCH, seed=0)
    loss_of(fp32, tokens, labels).backward()
    results = run_on_ranks(2, _fsdp_bf16)
    for grads, _, seen, sharded in results:
        assert seen == {(torch.bfloat16, "Parameter", torch.bfloat16)}  # computes in bf16
        assert sharded == {(torch.float32, "DTensor")}  # optimizer sees fp32 shards
        for step, (got, want) in enumerate(zip(grads, ref_grads, strict=True)):
            worst = max((_rel(got[k], want[k]), k) for k in want)
            assert worst[0] < BF16_REL, f"step {step}: grad {worst[1]} off by {worst[0]:.2e}"
        # bf16 really ran: an fp32 run's gradients differ by more than float rounding
        assert max(_rel(grads[0][n], p.grad) for n, p in fp32.named_parameters()) > 1e-4
    # each rank's loss is over its half of the batch; their mean is the full-batch loss
    mean = [(a + b) / 2 for a, b in zip(results[0][1], results[1][1], strict=True)]
    assert max(abs(a - b) for a, b in zip(mean, ref_losses, strict=True)) < 2e-2


def _meta_init() -> tuple[int, int, dict[str, torch.Tensor]]:
    from hyperpar import fully_shard
    from hyperpar.platform import get_platform

    pf = get_platform()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 6))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    model.to_empty(device=pf.device())
    materialised = sum(p.to_local().numel() for p in model.parameters())
    full = sum(p.numel() for p in model.parameters())
    with torch.no_grad():
        for p in model.parameters():  # deterministic init of each rank's rows
            local = p.to_local()
            rows = local.shape[0]
            start = pf.rank() * -(-p.shape[0] // pf.world_size())
            idx = torch.arange(start, start + rows, dtype=torch.float32)
            local.copy_((idx.view(-1, *[1] * (local.ndim - 1)) + 1).expand_as(local) / 10)
    x = torch.ones(2, 6)
    model(x).sum().backward()
    return materialised, full, {n: p.grad.full_tensor() for n, p in model.named_parameters()}


def test_meta_init_materialises_only_each_ranks_shards(run_on_ranks):
    results = run_on_ranks(2, _meta_init)
    ref = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 6))
    with torch.no_grad():
        for p in ref.parameters():
            idx = torch.arange(p.shape[0], dtype=torch.float32)
            p.copy_((idx.view(-1, *[1] * (p.ndim - 1)) + 1).expand_as(p) / 10)
    ref(torch.ones(2, 6)).sum().backward()
    want = {n: p.grad for n, p in ref.named_parameters()}
    for materialised, full, grads in results:
        assert materialised == full // 2
        assert_close_to_reference(grads, want, what="grads after meta init")


def _clip(max_norm: float, tp: bool) -> tuple[float, dict[str, torch.Tensor]]:
    from hyperpar import clip_grad_norm_, init_device_mesh, parallelize_module

    if tp:
        mesh = init_device_mesh((2, 2), mesh_dim_names=("dp", "tp"))
        model = llama.build(ARGS, seed=0)
        parallelize_module(model, mesh["tp"], llama_plan())
        shard_blocks(model, mesh=mesh["dp"])
        dp_rank, dp_size = mesh.get_local_rank("dp"), 2
    else:
        from hyperpar.platform import get_platform

        model = shard_blocks(llama.build(ARGS, seed=0))
        dp_rank, dp_size = get_platform().rank(), get_platform().world_size()
    tokens, labels = llama.batch(ARGS, batch_size=BATCH, seed=0)
    rows = rank_rows(dp_rank, dp_size)
    loss_of(model, tokens[rows], labels[rows]).backward()
    norm = clip_grad_norm_(model.parameters(), max_norm)
    return float(norm), {n: p.grad.full_tensor() for n, p in model.named_parameters()}


def llama_plan():
    from ._common import plans

    return plans.tp_plan()


@pytest.mark.parametrize("tp", [False, True], ids=["fsdp4", "dp2xtp2"])
def test_clip_grad_norm_gives_the_single_process_norm(run_on_ranks, tp):
    ref = llama.build(ARGS, seed=0)
    tokens, labels = llama.batch(ARGS, batch_size=BATCH, seed=0)
    loss_of(ref, tokens, labels).backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    assert want > 0.5  # so clipping really scales
    grads = {n: p.grad for n, p in ref.named_parameters()}
    for norm, got in run_on_ranks(4, _clip, 0.5, tp):
        assert abs(norm - float(want)) < 1e-5 * float(want)
        assert_close_to_reference(got, grads, what="clipped grads")


def _unshard_reshard() -> tuple[tuple, tuple, tuple]:
    from hyperpar import fully_shard

    model = fully_shard(nn.Linear(4, 6))
    sharded = (type(model.weight).__name__, tuple(model.weight.to_local().shape))
    model.unshard()
    unsharded = (type(model.weight).__name__, tuple(model.weight.shape))
    model.reshard()
    back = (type(model.weight).__name__, tuple(model.weight.to_local().shape))
    return sharded, unsharded, back


def test_unshard_and_reshard_swap_the_parameters(run_on_ranks):
    for sharded, unsharded, back in run_on_ranks(2, _unshard_reshard):
        assert sharded == back == ("DTensor", (3, 4))
        assert unsharded == ("Parameter", (6, 4))


def test_errors_name_the_problem_and_the_fix(run_on_ranks):
    run_on_ranks(2, _errors)


def _errors() -> None:
    from hyperpar import fully_shard

    class Scalar(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.tensor(2.0))

    with pytest.raises(ValueError, match="0-dim tensor.*shape \\(1,\\)"):
        fully_shard(Scalar())
    with pytest.raises(TypeError, match="apply fully_shard to each of its modules"):
        fully_shard(nn.ModuleList([nn.Linear(2, 2)]))
    lin = fully_shard(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="already fully_shard-ed"):
        fully_shard(lin)
    tied = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    tied[1].weight = tied[0].weight
    fully_shard(tied[1])  # tied inside one unit is supported; across two units it is refused
    with pytest.raises(ValueError, match="tied across two fully_shard units"):
        fully_shard(tied)


def _offload_and_eval() -> tuple[dict[str, torch.Tensor], set, int]:
    from hyperpar import CPUOffloadPolicy
    from hyperpar.platform import get_platform

    pf = get_platform()
    model = shard_blocks(llama.build(ARGS, seed=0), offload_policy=CPUOffloadPolicy())
    tokens, _ = llama.batch(ARGS, batch_size=BATCH, seed=0)
    with torch.no_grad():
        model(tokens)  # an eval forward leaves nothing gathered, the root included
    alive = sum(p.unsharded.untyped_storage().size() for m in model.modules()
                if hasattr(m, "_fsdp_group") for p in m._fsdp_group.params
                if p.unsharded is not None)
    train(model, rank_rows(pf.rank(), pf.world_size()))
    host = torch.empty(0).cpu().device
    devices = {p.to_local().device == host for p in model.parameters()}
    from ._common import full_state

    return full_state(model), devices, alive


def test_cpu_offload_trains_like_one_process_with_shards_on_the_host(run_on_ranks):
    from ._common import reference_state

    ref = reference_state()
    for state, on_host, alive in run_on_ranks(2, _offload_and_eval):
        assert on_host == {True}
        assert alive == 0
        assert_close_to_reference(state, ref, what="CPUOffloadPolicy fsdp2")


def _mesh_mismatch() -> None:
    from hyperpar import fully_shard, init_device_mesh, parallelize_module
    from hyperpar.parallel import ColwiseParallel

    tp_mesh = init_device_mesh((2,), mesh_dim_names=("tp",))
    dp_mesh = init_device_mesh((2,), mesh_dim_names=("dp",))
    model = nn.Sequential(nn.Linear(4, 4))
    parallelize_module(model, tp_mesh, {"0": ColwiseParallel()})
    with pytest.raises(ValueError, match="not a slice of the same named mesh"):
        fully_shard(model, mesh=dp_mesh)


def test_tp_and_dp_meshes_must_come_from_one_mesh(run_on_ranks):
    run_on_ranks(2, _mesh_mismatch)


def _state_dict_after_forward() -> tuple[set, set]:
    from hyperpar import fully_shard

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    fully_shard(model[0])
    fully_shard(model)
    out = model(torch.ones(2, 4)).sum()  # the root now holds its gathered tensors
    kinds = {type(v).__name__ for v in model.state_dict().values()}
    out.backward()  # backward re-gathers what state_dict() resharded
    return kinds, {type(p.grad).__name__ for p in model.parameters()}


def test_state_dict_between_forward_and_backward_holds_shards(run_on_ranks):
    for kinds, grads in run_on_ranks(2, _state_dict_after_forward):
        assert kinds == {"DTensor"}
        assert grads == {"DTensor"}
