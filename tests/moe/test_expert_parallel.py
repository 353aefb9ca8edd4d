"""Expert parallelism against one plain-torch process.

The distributed model: a torchtitan-style MoE block (router top-k -> tokens sorted by global
expert -> ``experts(routed_input, num_tokens_per_expert)`` -> unsort -> score-weighted sum) whose
grouped experts get ``ExpertParallel`` (2 and 4 ranks), ``ExpertTensorParallel`` (a 2x2
``(ep, tp)`` mesh) or ``ExpertParallel`` beside a dense ``ColwiseParallel`` on one 2-D mesh;
each ep group member its own batch. The reference: the same weights in one process, every
batch, each token through its top-k experts computed densely (every expert on every token, the
chosen ones gathered and weighted), and the capacity drop order written out as a loop here --
it shares no routing code with hyperpar.

Tolerance: fp32; every output element is a sum of <= 16-term dot products (dim 8, hidden 16)
times k = 2 weighted terms, summed in another order than the reference (segments, index_add);
the rounding is ~1e-6 relative on values of order 1, gradients sum <= 4 * 16 such terms: 1e-5
absolute and relative leaves margin on any x86 CPU and fails on any misrouted token, which
moves values by ~1e-1.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

DIM, HIDDEN, K, TOKENS, TOL = 8, 16, 2, 6, 1e-5


class GroupedExperts(nn.Module):
    """torchtitan's GroupedExperts layout (for-loop compute): ``w1``/``w3`` ``(E, hidden, dim)``,
    ``w2`` ``(E, dim, hidden)``; rows of ``x`` sorted by expert, ``counts`` per expert."""

    def __init__(self, num_experts: int, dim: int = DIM, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(num_experts, hidden, dim) * 0.3)
        self.w2 = nn.Parameter(torch.randn(num_experts, dim, hidden) * 0.3)
        self.w3 = nn.Parameter(torch.randn(num_experts, hidden, dim) * 0.3)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        outs = []
        for e, xe in enumerate(torch.split(x, [int(c) for c in counts.tolist()])):
            h = F.silu(xe @ self.w1[e].T) * (xe @ self.w3[e].T)
            outs.append(h @ self.w2[e].T)
        return torch.cat(outs) if outs else x[:0]


class MoE(nn.Module):
    """Router top-k over softmax scores, tokens sorted by expert, experts, weighted sum.
    ``logit_bias`` skews the routing (a large negative entry starves an expert)."""

    def __init__(self, num_experts: int, capacity_factor: float | None = None,
                 dense: bool = False, logit_bias: list[float] | None = None) -> None:
        super().__init__()
        from hyperpar.moe import check_moe_config

        check_moe_config(num_experts, K, capacity_factor=capacity_factor)
        self.num_experts, self.capacity_factor = num_experts, capacity_factor
        self.dense = nn.Linear(DIM, DIM) if dense else None
        self.router = nn.Linear(DIM, num_experts, bias=False)
        self.experts = GroupedExperts(num_experts)
        self.register_buffer("logit_bias", torch.tensor(logit_bias or [0.0] * num_experts))
        self.last_keep: list | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from hyperpar.moe import expert_capacity
        from hyperpar.torch.moe.dispatch import (
            capacity_keep_mask,
            check_router_scores,
            sort_by_expert,
        )

        if self.dense is not None:
            x = self.dense(x)
        scores = torch.softmax(self.router(x) + self.logit_bias, dim=-1)
        check_router_scores(scores)
        top, ids = scores.topk(K, dim=-1)
        keep = None
        if self.capacity_factor is not None:
            cap = expert_capacity(x.shape[0], self.num_experts, K, self.capacity_factor)
            keep = capacity_keep_mask(ids, self.num_experts, cap)
            self.last_keep = keep.tolist()
        order, counts = sort_by_expert(ids, self.num_experts, keep)
        token = order // K
        out = self.experts(x[token], counts) * top.reshape(-1)[order][:, None]
        return torch.zeros_like(x).index_add(0, token, out)


def _build(num_experts: int, **kw) -> MoE:
    torch.manual_seed(0)
    return MoE(num_experts, **kw)


def _batch(b: int, tokens: int = TOKENS) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + b)
    return torch.randn(tokens, DIM, generator=g), torch.randn(tokens, DIM, generator=g)


def _loss(y: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((y - target) ** 2).sum()


# ------------------------------------------------------------------------- the reference
def _ref_keep(ids: list[list[int]], num_experts: int, capacity: int) -> list[list[bool]]:
    """The stated drop order, written out: every token's first choice in token order, then
    every token's second choice; an expert takes assignments until it holds ``capacity``."""
    held = [0] * num_experts
    keep = [[False] * K for _ in ids]
    for c in range(K):
        for t in range(len(ids)):
            if held[ids[t][c]] < capacity:
                held[ids[t][c]] += 1
                keep[t][c] = True
    return keep


def _reference(num_experts: int, tokens: list[int], **kw) -> dict:
    import math

    model = _build(num_experts, **kw)
    e = model.experts
    out: dict = {"y": [], "loss": [], "router": [], "dense": [], "keep": []}
    total = 0.0
    for b, n in enumerate(tokens):
        x, target = _batch(b, n)
        h = model.dense(x) if model.dense is not None else x
        scores = torch.softmax(h @ model.router.weight.T + model.logit_bias, dim=-1)
        top, ids = scores.topk(K, dim=-1)
        weight = top.clone()
        if model.capacity_factor is not None:
            cap = min(n, math.ceil(n * K * model.capacity_factor / num_experts))
            keep = _ref_keep(ids.tolist(), num_experts, cap)
            weight = weight * torch.tensor(keep, dtype=weight.dtype).reshape(weight.shape)
            out["keep"].append(keep)
        every = torch.stack([(F.silu(h @ e.w1[j].T) * (h @ e.w3[j].T)) @ e.w2[j].T
                             for j in range(num_experts)], dim=1)  # (tokens, E, dim)
        chosen = every.gather(1, ids[:, :, None].expand(-1, -1, DIM))  # (tokens, K, dim)
        y = (chosen * weight[:, :, None]).sum(dim=1)
        loss = _loss(y, target)
        wrt = [model.router.weight] + ([model.dense.weight] if model.dense is not None else [])
        grads = torch.autograd.grad(loss, wrt, retain_graph=True)
        out["y"].append(y.detach())
        out["loss"].append(float(loss.detach()))
        out["router"].append(grads[0])
        out["dense"].append(grads[1] if len(grads) > 1 else None)
        total = total + loss
    total.backward()
    out["experts"] = {n: p.grad.clone() for n, p in e.named_parameters()}
    return out


# ------------------------------------------------------------------------- distributed runs
def _run_ep(num_experts: int, tokens: list[int], style: str, **kw) -> dict:
    from hyperpar import (
        ColwiseParallel,
        ExpertParallel,
        ExpertTensorParallel,
        Replicate,
        TensorParallel,
        init_device_mesh,
        parallelize_module,
    )
    from hyperpar.platform import get_platform

    world = get_platform().world_size()
    model = _build(num_experts, dense=style == "ep+dense_tp", **kw)
    if style == "ep":
        mesh = init_device_mesh((world,), mesh_dim_names=("ep",))
        parallelize_module(model, mesh, {"experts": ExpertParallel()})
        batch = mesh.get_local_rank()
    elif style == "tp":  # every expert on every rank, hidden dim over tp, one shared batch
        mesh = init_device_mesh((world,), mesh_dim_names=("tp",))
        parallelize_module(model, mesh, {"experts": TensorParallel(reduce_output=True)})
        batch = 0
    else:
        mesh = init_device_mesh((world // 2, 2), mesh_dim_names=("ep", "tp"))
        plan = ({"experts": ExpertTensorParallel(reduce_output=True)} if style == "etp" else
                {"dense": ColwiseParallel(output_layouts=Replicate()),
                 "experts": ExpertParallel()})
        parallelize_module(model, mesh, plan)
        batch = mesh.get_local_rank("ep")  # tp ranks of one ep coordinate share a batch
    x, target = _batch(batch, tokens[batch])
    y = model(x)
    loss = _loss(y, target)
    loss.backward()
    res = {"batch": batch, "y": y.detach(), "loss": float(loss),
           "router": model.router.weight.grad.clone(), "keep": model.last_keep,
           "placements": {n: tuple(p.placements) for n, p in model.experts.named_parameters()},
           "experts": {n: p.grad.full_tensor() for n, p in model.experts.named_parameters()}}
    if model.dense is not None:
        res["dense"] = model.dense.weight.grad.full_tensor()
    return res


def _check(results: list[dict], ref: dict) -> None:
    for res in results:
        b = res["batch"]
        torch.testing.assert_close(res["y"], ref["y"][b], atol=TOL, rtol=TOL)
        assert res["loss"] == pytest.approx(ref["loss"][b], rel=TOL, abs=TOL)
        torch.testing.assert_close(res["router"], ref["router"][b], atol=TOL, rtol=TOL)
        if "dense" in res:
            torch.testing.assert_close(res["dense"], ref["dense"][b], atol=TOL, rtol=TOL)
        for name, want in ref["experts"].items():
            torch.testing.assert_close(res["experts"][name], want, atol=TOL, rtol=TOL,
                                       msg=lambda m, name=name: f"grad of {name}: {m}")
        if ref["keep"]:
            assert res["keep"] == ref["keep"][b]


@pytest.mark.parametrize("n,experts", [(2, 4), (4, 8)])
def test_expert_parallel_matches_one_process(run_on_ranks, n, experts):
    from hyperpar import Shard

    tokens = [TOKENS] * n
    results = run_on_ranks(n, _run_ep, experts, tokens, "ep")
    _check(results, _reference(experts, tokens))
    assert all(p == (Shard(0),) for p in results[0]["placements"].values())


@pytest.mark.parametrize("n", [2, 4])
def test_skewed_routing_starved_expert_and_a_rank_sending_nothing(run_on_ranks, n):
    # expert 0 never chosen (its block on ep rank 0 computes on no rows); the last rank has
    # no tokens at all, yet its experts receive the others'.
    experts = 2 * n
    bias = [-1e4] + [0.0] * (experts - 1)
    tokens = [TOKENS] * (n - 1) + [0]
    ref = _reference(experts, tokens, logit_bias=bias)
    assert torch.count_nonzero(ref["experts"]["w1"][0]) == 0
    _check(run_on_ranks(n, _run_ep, experts, tokens, "ep", logit_bias=bias), ref)


@pytest.mark.parametrize("n", [2, 4])
def test_capacity_drops_exactly_the_tokens_the_reference_drops(run_on_ranks, n):
    experts, tokens = 2 * n, [8] * n
    ref = _reference(experts, tokens, capacity_factor=0.5)
    dropped = sum(not k for keep in ref["keep"] for row in keep for k in row)
    assert dropped > 0  # the case really drops
    _check(run_on_ranks(n, _run_ep, experts, tokens, "ep", capacity_factor=0.5), ref)


@pytest.mark.parametrize("style", ["etp", "ep+dense_tp"])
def test_expert_parallel_with_tensor_parallel_on_a_2x2_mesh(run_on_ranks, style):
    from hyperpar import Shard

    tokens = [TOKENS, TOKENS]
    results = run_on_ranks(4, _run_ep, 4, tokens, style)
    _check(results, _reference(4, tokens, dense=style == "ep+dense_tp"))
    want = ({"w1": (Shard(0), Shard(1)), "w2": (Shard(0), Shard(2)), "w3": (Shard(0), Shard(1))}
            if style == "etp" else {n: (Shard(0),) for n in ("w1", "w2", "w3")})
    assert results[0]["placements"] == want


def test_tensor_parallel_grouped_experts_matches_one_process(run_on_ranks):
    from hyperpar import Shard

    results = run_on_ranks(2, _run_ep, 4, [TOKENS], "tp")
    _check(results, _reference(4, [TOKENS]))
    assert results[0]["placements"] == {"w1": (Shard(1),), "w2": (Shard(2),), "w3": (Shard(1),)}
