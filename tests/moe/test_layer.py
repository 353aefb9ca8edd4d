"""The MoE layers against plain torch written token by token in one process.

* ``hyperpar.moe.MoE`` (router, grouped experts, shared experts) in one process: output and the
  gradient of every weight equal a per-token loop over each token's top-k experts.
* DeepSpeed's ``MoE`` (``hyperpar.moe.deepspeed``) on 2 and 4 gloo ranks (``ep_size`` 2 and 4),
  top-1 and top-2 with capacity dropping: every rank's output, ``l_aux`` and ``exp_counts``,
  and after :func:`allreduce_gradients` the gate's and every expert's gradient, equal one process
  that gates each rank's tokens by GShard's rule (capacity from the rank's token count; first
  choices in token order, then second choices; tokens past capacity dropped), and differentiates
  the mean of the ranks' losses.

Tolerance: float32, each value a sum of at most ~40 products of O(1) numbers reordered
(einsum / grouped GEMM against per-token matmuls), ~1e-6 relative; 1e-5 leaves margin and fails
on any wrongly routed or dropped token (which moves outputs by O(0.1)).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ._reference import reference_moe

TOL = 1e-5
DIM, HID = 8, 16


# ------------------------------------------------------------------ hyperpar.moe.MoE, one process
@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize(("top_k", "score_func", "before", "n_shared"), [
    (1, "softmax", True, 0), (2, "softmax", False, 1), (3, "sigmoid", True, 2)])
def test_moe_layer_matches_a_token_by_token_reference(grouped, top_k, score_func, before,
                                                       n_shared):
    from hyperpar.moe import MoE, grouped_mm_available

    if grouped and not grouped_mm_available():
        pytest.skip(f"torch {torch.__version__} has no torch._grouped_mm")
    torch.manual_seed(0)
    moe = MoE(DIM, HID, num_experts=4, top_k=top_k, num_shared_experts=n_shared,
              score_func=score_func, score_before_experts=before, use_grouped_mm=grouped)
    for p in moe.parameters():  # O(1) weights: every routing decision moves the output
        nn.init.normal_(p, std=0.5)
    x = torch.randn(2, 7, DIM)
    y = moe(x)
    (y.square().sum() + moe.aux_loss).backward()

    ref = {k: v.detach().clone().requires_grad_() for k, v in moe.named_parameters()}
    shared = None
    if n_shared:
        shared = [ref[f"shared_experts.{w}.weight"] for w in ("w1", "w2", "w3")]
    want = reference_moe(x.reshape(-1, DIM), ref["router.gate.weight"], ref["experts.w1"],
                          ref["experts.w2"], ref["experts.w3"], shared, top_k, score_func,
                          before).reshape(x.shape)
    logits = x.reshape(-1, DIM) @ ref["router.gate.weight"].T
    scores = logits.softmax(-1) if score_func == "softmax" else logits.sigmoid()
    ids = scores.topk(top_k, -1).indices.reshape(-1)
    share = torch.stack([(ids == e).sum() for e in range(4)]).float() / ids.numel()
    aux = 4 * (share * scores.mean(0)).sum()  # the switch loss, by its definition
    (want.square().sum() + aux).backward()
    torch.testing.assert_close(y, want, atol=TOL, rtol=TOL)
    torch.testing.assert_close(moe.aux_loss, aux, atol=TOL, rtol=TOL)
    for name, p in moe.named_parameters():
        torch.testing.assert_close(p.grad, ref[name].grad, atol=TOL, rtol=TOL, msg=name)
    assert moe.tokens_per_expert.sum() == 14 * top_k


def test_expert_bias_update_follows_the_sign_rule_and_steers_routing():
    from hyperpar.moe import MoE, update_expert_bias

    moe = MoE(DIM, HID, num_experts=4, top_k=1, load_balance_coeff=0.1)
    moe.tokens_per_expert.copy_(torch.tensor([5.0, 1.0, 1.0, 1.0]))  # expert 0 overloaded
    update_expert_bias(moe)
    # mean 2: sign(2 - counts) = (-1, 1, 1, 1), times 0.1, centred: (-0.15, 0.05, 0.05, 0.05)
    torch.testing.assert_close(moe.expert_bias, torch.tensor([-0.15, 0.05, 0.05, 0.05]))
    assert moe.tokens_per_expert.sum() == 0
    with torch.no_grad():  # a bias large enough moves every token off expert 0
        moe.expert_bias.copy_(torch.tensor([-10.0, 10.0, 0.0, 0.0]))
    moe(torch.randn(5, DIM))
    assert moe.tokens_per_expert.tolist() == [0.0, 5.0, 0.0, 0.0]


def test_bad_router_arguments_and_nan_scores_are_named():
    from hyperpar.moe import MoE, RouterNaNError

    with pytest.raises(ValueError, match="top_k=5 must lie in 1..num_experts=4"):
        MoE(DIM, HID, num_experts=4, top_k=5)
    moe = MoE(DIM, HID, num_experts=4)
    with pytest.raises(RouterNaNError, match="router scores contain NaN"):
        moe(torch.full((3, DIM), float("nan")))


# ------------------------------------------------------------------ DeepSpeed's MoE, 2 and 4 ranks
S, E = 12, 4  # tokens per rank, experts


def _expert() -> nn.Module:
    return nn.Sequential(nn.Linear(DIM, HID), nn.ReLU(), nn.Linear(HID, DIM))


def _expert_weights(e: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + e)
    return [torch.randn(HID, DIM, generator=g) * 0.5, torch.randn(HID, generator=g) * 0.1,
            torch.randn(DIM, HID, generator=g) * 0.5, torch.randn(DIM, generator=g) * 0.1]


def _gate_weight() -> torch.Tensor:
    return torch.randn(E, DIM, generator=torch.Generator().manual_seed(7))


def _tokens(rank: int) -> torch.Tensor:
    return torch.randn(S, DIM, generator=torch.Generator().manual_seed(rank))


def _deepspeed_rank(ep_size: int, k: int) -> dict:
    from hyperpar.moe.deepspeed import MoE, allreduce_gradients
    from hyperpar.platform import get_platform

    rank, world = get_platform().rank(), get_platform().world_size()
    layer = MoE(DIM, _expert(), num_experts=E, ep_size=ep_size, k=k, capacity_factor=1.0,
                min_capacity=0, use_rts=False, top2_2nd_expert_sampling=False)
    local = E // ep_size
    first = (rank % ep_size) * local  # DeepSpeed: ep groups of consecutive ranks
    with torch.no_grad():
        layer.deepspeed_moe.gate.wg.weight.copy_(_gate_weight())
        for i, expert in enumerate(layer.deepspeed_moe.experts.deepspeed_experts):
            for p, w in zip(expert.parameters(), _expert_weights(first + i), strict=True):
                p.copy_(w)
    out, l_aux, counts = layer(_tokens(rank))
    (0.5 * out.square().sum() / S + 0.1 * l_aux).backward()
    allreduce_gradients(layer)
    experts = {first + i: [p.grad.clone() for p in ex.parameters()]
               for i, ex in enumerate(layer.deepspeed_moe.experts.deepspeed_experts)}
    return {"out": out.detach(), "l_aux": float(l_aux), "counts": counts.tolist(),
            "gate": layer.deepspeed_moe.gate.wg.weight.grad.clone(), "experts": experts,
            "world": world}


def _mlp(x, w):
    return F.linear(F.relu(F.linear(x, w[0], w[1])), w[2], w[3])


def _gshard_rank(x, gate_w, experts, k):
    """One rank's tokens gated by GShard's rule, written out per token."""
    gates = (x @ gate_w.T).softmax(-1)
    first = [int(g.detach().argmax()) for g in gates]
    choices = [[e] for e in first]
    if k == 2:
        for t in range(S):
            rest = [e for e in range(E) if e != first[t]]
            choices[t].append(max(rest, key=lambda e: float(gates[t, e].detach())))
    cap = max(math.ceil(S / E * k), 0)
    fill = [0] * E
    slot = [[None] * k for _ in range(S)]
    for j in range(k):  # all first choices, in token order, then all second choices
        for t in range(S):
            e = choices[t][j]
            slot[t][j] = fill[e]
            fill[e] += 1
    out, dropped = [], 0
    for t in range(S):
        kept = [j for j in range(k) if slot[t][j] < cap]
        dropped += k - len(kept)
        g = [gates[t, choices[t][j]] for j in range(k)]
        norm = sum(g[j] for j in kept) if k == 2 else 1.0
        y = torch.zeros(DIM)
        for j in kept:
            y = y + g[j] / norm * _mlp(x[t], experts[choices[t][j]])
        out.append(y)
    share = torch.tensor([sum(1 for c in first if c == e) for e in range(E)]) / S
    me = gates.mean(0)
    l_aux = (me * share).sum() * E if k == 1 else (me * share).mean() * E * E
    counts = [sum(1 for c in choices for e2 in c if e2 == e) for e in range(E)]
    return torch.stack(out), l_aux, counts, dropped


@pytest.mark.parametrize(("n", "ep_size"), [(2, 2), (4, 2), (4, 4)])
@pytest.mark.parametrize("k", [1, 2])
def test_deepspeed_moe_with_capacity_drops_matches_one_process(run_on_ranks, n, ep_size, k):
    results = run_on_ranks(n, _deepspeed_rank, ep_size, k)
    gate_w = _gate_weight().requires_grad_()
    experts = [[w.requires_grad_() for w in _expert_weights(e)] for e in range(E)]
    loss, dropped = 0.0, 0
    for rank, res in enumerate(results):
        want, l_aux, counts, drops = _gshard_rank(_tokens(rank), gate_w, experts, k)
        torch.testing.assert_close(res["out"], want.detach(), atol=TOL, rtol=TOL)
        assert res["l_aux"] == pytest.approx(float(l_aux), abs=TOL)
        assert res["counts"] == counts
        dropped += drops
        loss = loss + (0.5 * want.square().sum() / S + 0.1 * l_aux) / n
    assert dropped > 0, "the case must drop tokens to test the capacity rule"
    loss.backward()
    for res in results:
        torch.testing.assert_close(res["gate"], gate_w.grad, atol=TOL, rtol=TOL)
        for e, grads in res["experts"].items():
            for got, w in zip(grads, experts[e], strict=True):
                torch.testing.assert_close(got, w.grad, atol=TOL, rtol=TOL, msg=f"expert {e}")


def _bad_ep_size() -> str:
    from hyperpar.moe.deepspeed import MoE

    try:
        MoE(DIM, _expert(), num_experts=6, ep_size=3)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_deepspeed_ep_size_not_dividing_the_world_is_refused_on_every_rank(run_on_ranks):
    for msg in run_on_ranks(2, _bad_ep_size):
        assert "ep_size=3 must divide the world size 2" in msg, msg


def test_deepspeed_rank_layout_is_deepspeeds():
    from hyperpar.moe.deepspeed import expert_parallel_ranks

    # deepspeed.utils.groups' docstring example: world 16, ep 2
    ep, edp = expert_parallel_ranks(16, 2)
    assert ep[:3] == [[0, 1], [2, 3], [4, 5]]
    assert edp == [list(range(0, 16, 2)), list(range(1, 16, 2))]
    with pytest.raises(ValueError, match="Number of experts"):
        from hyperpar.moe.deepspeed import MoE
        MoE(DIM, _expert(), num_experts=3, ep_size=2)


# ------------------------------------------------------------------ hyperpar.moe.MoE under EP
def _moe_under_ep(n_experts: int, top_k: int, skew: bool) -> dict:
    from hyperpar import ExpertParallel, init_device_mesh, parallelize_module
    from hyperpar.moe import MoE
    from hyperpar.platform import get_platform

    platform = get_platform()
    rank, world = platform.rank(), platform.world_size()
    mesh = init_device_mesh((world,), mesh_dim_names=("ep",))
    torch.manual_seed(0)
    moe = MoE(DIM, HID, num_experts=n_experts, top_k=top_k, num_shared_experts=1)
    for p in moe.parameters():
        nn.init.normal_(p, std=0.5)
    if skew:  # every token prefers expert 0: the other experts see few or none
        with torch.no_grad():
            moe.router.gate.weight[0].zero_()
            moe.router.gate.bias = None
    parallelize_module(moe, mesh, {"experts": ExpertParallel()})
    x = _ep_tokens(rank, skew)
    y = moe(x)
    (y.square().sum() / world).backward()
    dense = {}
    for name, p in moe.named_parameters():
        if not name.startswith("experts."):  # replicated: each rank holds its tokens' part
            g = p.grad.clone()
            platform.all_reduce(g, "sum")
            dense[name] = g
    experts = {name: p.grad.full_tensor() for name, p in moe.experts.named_parameters(
        prefix="experts")}
    return {"y": y.detach(), "dense": dense, "experts": experts,
            "local": tuple(moe.experts.w1.to_local().shape)}


def _ep_tokens(rank: int, skew: bool) -> torch.Tensor:
    x = torch.randn(6, DIM, generator=torch.Generator().manual_seed(rank))
    if skew:
        x[:, 0] = 4.0 + rank  # input dim 0 pushes the logits apart
    return x


@pytest.mark.parametrize(("n", "n_experts", "top_k", "skew"), [
    (2, 4, 2, False), (4, 8, 2, False), (4, 4, 1, True)])
def test_moe_under_expert_parallel_matches_one_process(run_on_ranks, n, n_experts, top_k, skew):
    results = run_on_ranks(n, _moe_under_ep, n_experts, top_k, skew)
    from hyperpar.moe import MoE

    torch.manual_seed(0)
    moe = MoE(DIM, HID, num_experts=n_experts, top_k=top_k, num_shared_experts=1)
    for p in moe.parameters():
        nn.init.normal_(p, std=0.5)
    ref = {k: v.detach().clone().requires_grad_() for k, v in moe.named_parameters()}
    if skew:
        with torch.no_grad():
            ref["router.gate.weight"][0].zero_()
    shared = [ref[f"shared_experts.{w}.weight"] for w in ("w1", "w2", "w3")]
    loss = 0.0
    for rank, res in enumerate(results):
        want = reference_moe(_ep_tokens(rank, skew), ref["router.gate.weight"],
                              ref["experts.w1"], ref["experts.w2"], ref["experts.w3"], shared,
                              top_k, "softmax", True)
        torch.testing.assert_close(res["y"], want.detach(), atol=TOL, rtol=TOL)
        loss = loss + want.square().sum() / n
        assert res["local"] == (n_experts // n, HID, DIM)
    loss.backward()
    for res in results:
        for name, g in {**res["dense"], **res["experts"]}.items():
            torch.testing.assert_close(g, ref[name].grad, atol=TOL, rtol=TOL, msg=name)
