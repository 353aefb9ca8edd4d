"""The MoE planner's layouts, parameter states per rank, schedules and all-to-all, checked
against numbers worked out by hand from the model's shapes (each test says how)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from hyperpar.plan.devices import get_profile
from hyperpar.plan.layout import Run
from hyperpar.plan.moe import moe_from_hf_config
from hyperpar.plan.moe_plan import (
    a2a_seconds,
    bubble_factor,
    enumerate_moe_layouts,
    moe_evaluate,
    moe_memory_per_rank,
    parse_moe_layout,
    stage_param_counts,
    tile_efficiency,
)

from ._common import ROOT

CONFIGS = ROOT / "tests" / "plan" / "configs"


def _spec(name: str):
    return moe_from_hf_config(json.loads((CONFIGS / f"{name}.json").read_text()))


@pytest.mark.parametrize("name", ["dp128.pp16.ep64.nl4.mb120.zero1.dualpipe",
                                  "fsdp8.tp2.ep4.etp2.mb4.ac", "fsdp8.ep8.cap125.mb2"])
def test_layout_names_round_trip(name) -> None:
    lay = parse_moe_layout(name)
    assert lay.name == name
    assert parse_moe_layout(lay.name) == lay


def test_expert_groups() -> None:
    """Megatron's groups: 2048 ranks, pp16, ep64 -> edp = 2048 / (16 x 64) = 2; under
    fully_shard on 16 ranks with ep 4 the experts shard over 16 / 4 = 4 ranks."""
    assert parse_moe_layout("dp128.pp16.ep64.mb16.zero1").edp == 2
    lay = parse_moe_layout("fsdp16.ep4.mb1")
    assert (lay.edp, lay.expert_shard) == (4, 4)
    hsdp = parse_moe_layout("dp2.fsdp8.ep4.mb1")
    assert (hsdp.edp, hsdp.expert_shard) == (4, 2)


def test_routed_states_split_over_ep_exactly() -> None:
    """Mixtral on 8 ranks, fully_shard 8: with ep 1 every expert is sharded over 8 ranks, with
    ep 8 each rank holds one expert whole (edp 1): the routed elements per rank are the same
    (all experts / 8) either way, and equal 32 layers x 8 experts x 3 x 4096 x 14336 / 8."""
    spec = _spec("mixtral-8x7b")
    run = Run(world=8, seq_len=4096, global_batch=8)
    routed = 32 * 8 * 3 * 4096 * 14336
    for ep in (1, 8):
        lay = parse_moe_layout(f"fsdp8.ep{ep}.mb1")
        dense, local_routed, _ = stage_param_counts(spec, lay, 0)
        assert local_routed == routed / ep
        assert local_routed / lay.expert_shard == routed / 8
        assert dense == spec.parameters - routed
        mem = moe_memory_per_rank(spec, run, lay)
        # fp32 masters, grads and two Adam states of (dense + routed) / 8 elements
        assert mem.states == pytest.approx(16 * spec.parameters / 8, rel=1e-9)


def test_zero1_partitions_masters_and_states_over_each_group() -> None:
    """ZeRO-1 (DeepSeek-V3's layout): bf16 params and grads whole (2 + 2 bytes), fp32 master
    and Adam states (12 bytes) over dp for the dense part and over edp for the experts."""
    spec = _spec("deepseek-v3")
    lay = parse_moe_layout("dp128.pp16.ep64.mb32.zero1")
    run = Run(world=2048, seq_len=4096, global_batch=4096)
    dense, routed, _ = stage_param_counts(spec, lay, 5)
    from hyperpar.plan.moe_plan import moe_stage_memory
    m = moe_stage_memory(spec, run, lay, 5)
    assert m.params == int((dense + routed) * 2)
    assert m.optimizer == int((dense / 128 + routed / lay.edp) * 12)


def test_dualpipe_bubble_is_the_published_formula() -> None:
    """DeepSeek-V3 Table 2: DualPipe (pp/2 - 1)(F&B + B - 3W) against 1F1B (pp - 1)(F + B);
    with F = W = (F + B) / 3 and F&B = F + B: pp 16 gives 7 x 2/3 against 15."""
    lay = parse_moe_layout("dp128.pp16.ep64.mb32.zero1.dualpipe")
    assert bubble_factor(lay) * 15 == pytest.approx(7 * 2 / 3)
    assert bubble_factor(parse_moe_layout("dp128.pp16.ep64.mb32.zero1.zbh1")) == 1 / 3


def test_dualpipe_holds_two_stages_of_parameters() -> None:
    spec = _spec("deepseek-v3")
    one = stage_param_counts(spec, parse_moe_layout("dp128.pp16.ep64.mb32.zero1"), 5)
    two = stage_param_counts(spec, parse_moe_layout("dp128.pp16.ep64.mb32.zero1.dualpipe"), 5)
    # stage 5 and stage 10 hold 4 MoE layers each (61 layers: 3, 4, ... as stage_layers says)
    assert two[1] == pytest.approx(2 * one[1])


def test_tile_efficiency() -> None:
    """128-wide tiles: 96 rows of a 768-wide expert use 96/128 of their tiles."""
    assert tile_efficiency(96, 768) == pytest.approx(0.75)
    assert tile_efficiency(256, 2048) == 1.0
    assert tile_efficiency(200, 1408) == pytest.approx(200 / 256 * 1408 / 1408)


def test_node_limited_routing_cuts_network_bytes() -> None:
    """DeepSeek-V3, ep 64 over 8 nodes: without a limit each of a token's 8 copies goes to
    another node with probability 56/64 (7 copies' worth); with nl4 it crosses once per
    reached node, 4 x 7/8 = 3.5: the network part halves, so the dispatch is faster."""
    spec = _spec("deepseek-v3")
    run = Run(world=2048, seq_len=4096, global_batch=4096)
    prof = get_profile("h800")
    free = parse_moe_layout("dp128.pp16.ep64.mb32.zero1")
    limited = replace(free, node_limit=4)
    t_free = a2a_seconds(spec, run, free, prof, 4096)
    t_lim = a2a_seconds(spec, run, limited, prof, 4096)
    net = prof.inter_bytes_per_s * prof.link_efficiency
    row = 7168 * 2
    assert t_free == pytest.approx(4096 * 7 * row / net + prof.inter_alpha_s
                                   + prof.intra_alpha_s)
    assert t_lim == pytest.approx(4096 * 3.5 * row / net + prof.inter_alpha_s
                                  + prof.intra_alpha_s)
    assert a2a_seconds(spec, run, parse_moe_layout("dp128.pp16.mb32.zero1"), prof, 4096) == 0


def test_enumeration_includes_ep_and_dualpipe_and_every_layout_is_checked() -> None:
    spec = _spec("qwen3-30b-a3b")
    run = Run(world=16, seq_len=4096, global_batch=64)
    layouts = enumerate_moe_layouts(spec, run)
    assert {lay.ep for lay in layouts} >= {1, 2, 4, 8, 16}
    assert any(lay.dualpipe for lay in layouts) and any(lay.etp > 1 for lay in layouts)
    assert all(lay.world == 16 for lay in layouts)
    # every enumerated layout divides the stage's ranks (the others are never generated)
    assert all(16 // lay.base.pp % (lay.ep * lay.etp) == 0 for lay in layouts)


def test_capacity_factor_scales_the_routed_activations() -> None:
    """cap125 computes 1.25x the balanced rows: the routed term (top_k copies of the
    dispatched input, expert output and 4 SwiGLU intermediates per token) grows by a quarter,
    nothing else does."""
    from hyperpar.plan.moe_plan import moe_layer_activation_elems

    spec = _spec("qwen3-30b-a3b")
    run = Run(world=8, seq_len=4096, global_batch=64)
    dropless = moe_layer_activation_elems(spec, run, parse_moe_layout("fsdp8.ep8.mb1"))
    capped = moe_layer_activation_elems(spec, run, parse_moe_layout("fsdp8.ep8.cap125.mb1"))
    assert capped[0] - dropless[0] == pytest.approx(0.25 * 8 * (2 * 2048 + 4 * 768))
    assert capped[1:] == dropless[1:]


def test_refusals_name_the_problem() -> None:
    spec = _spec("qwen3-30b-a3b")
    run = Run(world=8, seq_len=4096, global_batch=64)
    with pytest.raises(ValueError, match="cp=2 with an MoE model"):
        moe_evaluate(spec, run, parse_moe_layout("fsdp4.cp2.ep4.mb1"), get_profile("h100"))
    with pytest.raises(ValueError, match="dualpipe needs an even pp"):
        moe_evaluate(spec, run, parse_moe_layout("fsdp2.pp4.ep2.mb5.dualpipe"),
                     get_profile("h100"))
    with pytest.raises(ValueError, match="capacity factor below 1"):
        parse_moe_layout("fsdp8.ep8.cap50")


def test_search_ranks_ep_layouts_for_deepseek_v3_on_2048() -> None:
    """A DeepSeek-V3-sized search on 2,048 devices runs and ranks layouts with ep > 1 (its
    time is measured in benchmarks/validate_published.py, not asserted)."""
    from hyperpar.plan.moe_plan import moe_plan

    spec = _spec("deepseek-v3")
    run = Run(world=2048, seq_len=4096, global_batch=15360)
    ranked, ruled, n = moe_plan(spec, run, get_profile("h800"))
    assert n == len(ranked) + len(ruled) and ranked
    assert any(c.layout.ep > 1 for c in ranked)
    assert all(c.memory.peak <= run.device_memory for c in ranked)
