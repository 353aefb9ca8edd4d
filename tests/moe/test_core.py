"""The framework-neutral MoE core: placement, the efsdp groups, routing bookkeeping, the drop
order and the argument checks. Pure Python, no processes; the per-token orders are checked
against brute-force models written here (lists of token labels moved about), not against the
functions themselves."""

from __future__ import annotations

import itertools
import random

import pytest

from hyperpar.dtensor.placement import Shard
from hyperpar.moe import (
    ExpertPlacement,
    MoEConfigError,
    MoERoutingError,
    capacity_keep,
    check_moe_config,
    dispatch_plan,
    expert_capacity,
    expert_weight_placements,
    sparse_layout,
)
from hyperpar.moe.placement import mesh_dim_index
from hyperpar.moe.routing import (
    check_counts,
    expand_segments,
    inverse_permutation,
    raise_on_status,
    reference_count_exchange,
    stable_sort_by_expert,
)


def test_contiguous_blocks_own_every_expert_once():
    p = ExpertPlacement(12, 4)
    assert p.num_local == 3
    owned = [e for r in range(4) for e in p.local_experts(r)]
    assert owned == list(range(12))
    assert [p.owner(e) for e in range(12)] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]


def test_experts_not_divisible_by_ep_refused_naming_the_fix():
    with pytest.raises(MoEConfigError, match=r"num_experts=6 is not divisible.*ep=4.*1, 2, 3, 6"):
        ExpertPlacement(6, 4)


@pytest.mark.parametrize("k", [0, 9, 2.0, True])
def test_top_k_outside_one_to_experts_refused(k):
    with pytest.raises(MoEConfigError, match="top_k"):
        check_moe_config(8, k, 2)


def test_ep_not_dividing_world_refused():
    with pytest.raises(MoEConfigError, match="ep=4 does not divide the world size 6"):
        check_moe_config(8, 2, 4, world_size=6)


@pytest.mark.parametrize("cf", [0, -1.0, float("nan"), float("inf")])
def test_capacity_factor_not_positive_refused(cf):
    with pytest.raises(MoEConfigError, match="capacity_factor"):
        check_moe_config(8, 2, 2, capacity_factor=cf)


def test_mesh_without_the_named_dim_refused():
    assert mesh_dim_index(("dp", "ep"), "ep") == 1
    with pytest.raises(MoEConfigError, match=r"named 'ep'.*\('dp', 'tp'\)"):
        mesh_dim_index(("dp", "tp"), "ep", "ExpertParallel")


def test_capacity_is_the_scaled_even_share():
    # 10 tokens, top-2, 4 experts: 20 assignments, 5 each; x1.25 -> 6.25 -> 7.
    assert expert_capacity(10, 4, 2, 1.25) == 7
    assert expert_capacity(10, 4, 2, 1.0, min_capacity=9) == 9
    assert expert_capacity(3, 2, 2, 4.0) == 3  # never more than the tokens


def _brute_sparse_groups(world, pp, dpr, efsdp, ep):
    grid = {}
    for r, c in enumerate(itertools.product(range(pp), range(dpr), range(efsdp), range(ep))):
        grid[r] = c
    def group(rank, free):
        c = grid[rank]
        return tuple(sorted(r for r, d in grid.items()
                            if all(d[i] == c[i] for i in range(4) if i not in free)))
    return grid, group


@pytest.mark.parametrize("world,kw", [
    (8, dict(ep=2)), (8, dict(ep=4, tp=2)), (16, dict(ep=4, pp=2, dp_replicate=2)),
    (8, dict(ep=8, cp=2)), (4, dict(ep=1)),
])
def test_sparse_layout_matches_torchtitans_unflatten(world, kw):
    pp, dpr = kw.get("pp", 1), kw.get("dp_replicate", 1)
    ep = kw["ep"]
    efsdp = world // (pp * dpr * ep)
    grid, group = _brute_sparse_groups(world, pp, dpr, efsdp, ep)
    for rank in range(world):
        lay = sparse_layout(rank, world, **kw)
        assert lay.shape == (pp, dpr, efsdp, ep) and lay.coords == grid[rank]
        assert lay.ep_group == group(rank, {3})
        assert lay.efsdp_group == group(rank, {2})
        assert lay.expert_dp_group == group(rank, {1, 2})
        # ranks in one efsdp group own the same experts: same ep coordinate
        assert {grid[r][3] for r in lay.efsdp_group} == {lay.ep_rank}


def test_sparse_layout_refuses_ep_not_dividing_its_region():
    with pytest.raises(MoEConfigError, match=r"ep=3 must divide dp_shard \* cp \* tp = 4"):
        sparse_layout(0, 8, ep=3, pp=2)
    with pytest.raises(MoEConfigError, match="!= world size 8"):
        sparse_layout(0, 8, ep=2, dp_shard=3)


def test_weight_placements_per_style():
    assert expert_weight_placements("ExpertParallel", "bias", 2) == (Shard(0),)
    assert expert_weight_placements("TensorParallel", "w2", 3) == (Shard(2),)
    assert expert_weight_placements("ExpertTensorParallel", "w1", 3) == (Shard(0), Shard(1))
    with pytest.raises(MoEConfigError, match="does not know how to shard parameter 'gate'"):
        expert_weight_placements("TensorParallel", "gate", 3)
    with pytest.raises(MoEConfigError, match="must be 3-D"):
        expert_weight_placements("ExpertTensorParallel", "w1", 2)


def _simulate(all_tokens, placement):
    """Brute-force dispatch: each rank's tokens are labels (rank, expert, i) sorted by expert;
    move them as an all-to-all would and group by local expert, source rank inner."""
    ep = placement.ep
    received = []
    for d in range(ep):
        buf = []
        for s in range(ep):
            buf += [t for t in all_tokens[s] if placement.owner(t[1]) == d]
        received.append(buf)
    grouped = [[t for j in placement.local_experts(d) for t in received[d] if t[1] == j]
               for d in range(ep)]
    return received, grouped


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("experts,ep", [(4, 2), (8, 4), (6, 3), (4, 4), (5, 1)])
def test_dispatch_plan_groups_tokens_like_the_brute_force_move(seed, experts, ep):
    rng = random.Random(seed)
    placement = ExpertPlacement(experts, ep)
    sends = []
    all_tokens = []
    for s in range(ep):
        counts = [rng.choice([0, 0, 1, 2, 5]) for _ in range(experts)]
        if seed == 0 and s == ep - 1:
            counts = [0] * experts  # one rank sends nothing
        sends.append(counts)
        all_tokens.append([(s, e, i) for e in range(experts) for i in range(counts[e])])
    recvs = reference_count_exchange(sends, placement)
    received, grouped = _simulate(all_tokens, placement)
    for d in range(ep):
        plan = dispatch_plan(sends[d], recvs[d], placement)
        # splits: what d sends to each rank / receives from each rank
        assert list(plan.input_splits) == [
            sum(1 for t in all_tokens[d] if placement.owner(t[1]) == x) for x in range(ep)]
        assert list(plan.output_splits) == [
            sum(1 for t in all_tokens[s] if placement.owner(t[1]) == d) for s in range(ep)]
        assert sum(plan.segment_sizes) == len(received[d])
        perm = plan.permutation()
        assert [received[d][i] for i in perm] == grouped[d]
        assert list(plan.tokens_per_local_expert) == [
            sum(1 for t in grouped[d] if t[1] == j) for j in placement.local_experts(d)]
        # segment form == per-row form, and the inverse restores the received order
        segs = _split(received[d], plan.segment_sizes)
        assert [t for i in plan.segment_order for t in segs[i]] == grouped[d]
        back = _split(grouped[d], plan.expert_major_sizes)
        assert [t for i in plan.inverse_segment_order for t in back[i]] == received[d]
        inv = plan.inverse()
        assert [grouped[d][i] for i in inv] == received[d]


def _split(xs, sizes):
    out, at = [], 0
    for s in sizes:
        out.append(xs[at:at + s])
        at += s
    return out


def test_dispatch_plan_refuses_bad_counts():
    p = ExpertPlacement(4, 2)
    with pytest.raises(MoERoutingError, match="has 3 entries, but the experts hold 4"):
        dispatch_plan([1, 2, 3], [0, 0, 0, 0], p)
    with pytest.raises(MoERoutingError, match=">= 0"):
        dispatch_plan([1, -2, 3, 0], [0, 0, 0, 0], p)
    with pytest.raises(MoERoutingError, match="sums to 3, but routed_input has 4 rows"):
        check_counts([1, 2, 0, 0], 4, num_rows=4)


def test_inverse_permutation_and_expand():
    assert expand_segments([2, 0, 3], [2, 0, 1]) == [2, 3, 4, 0, 1]
    assert inverse_permutation([2, 0, 1]) == [1, 2, 0]
    with pytest.raises(MoERoutingError, match="not a permutation"):
        inverse_permutation([0, 0])


def test_stable_sort_keeps_ties_in_token_order():
    order, counts = stable_sort_by_expert([2, 0, 2, 1, 0], 3)
    assert order == [1, 4, 3, 0, 2] and counts == [2, 1, 2]


def test_capacity_keep_drops_in_the_stated_order():
    # 4 tokens, top-2, capacity 2. First choices: t0->0, t1->0, t2->0, t3->1;
    # expert 0 takes t0, t1 (first choices in token order), drops t2's first choice.
    # Second choices: t0->1, t1->2, t2->1, t3->0: expert 1 has t3 (1 kept) -> takes t0, drops t2;
    # expert 2 takes t1; expert 0 is full -> drops t3's second choice.
    ids = [[0, 1], [0, 2], [0, 1], [1, 0]]
    keep = capacity_keep(ids, 3, 2)
    assert keep == [[True, True], [True, True], [False, False], [True, False]]


@pytest.mark.parametrize("seed", range(5))
def test_capacity_keep_against_a_priority_model(seed):
    rng = random.Random(seed)
    tokens, experts, k, cap = 12, 4, 2, 3
    ids = [rng.sample(range(experts), k) for _ in range(tokens)]
    keep = capacity_keep(ids, experts, cap)
    # Model: priority of (t, c) is (c, t); an assignment survives iff fewer than cap
    # assignments to its expert have a smaller priority and were kept -- i.e. it is among
    # the first cap by priority for its expert.
    for e in range(experts):
        assigned = sorted((c, t) for t in range(tokens) for c in range(k) if ids[t][c] == e)
        kept = {(t, c) for c, t in assigned[:cap]}
        for c, t in assigned:
            assert keep[t][c] == ((t, c) in kept)


def test_raise_on_status_names_every_bad_rank():
    raise_on_status([0, 0, 0])
    with pytest.raises(MoERoutingError, match=r"ep rank 1: .*NaN.*ep rank 2: .*sum"):
        raise_on_status([0, 2, 1])
