"""Device profiles with group fixed costs per group size: old profiles (one number per cost)
still load and mean what they meant, tables by group size load, round-trip and are looked up
by the size of the group the layout pays them over (exact, else the nearest measured size on a
log scale, a tie to the larger), and bad tables are refused naming the key. Torch-free."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from hyperpar.plan.devices import GROUP_COSTS, PROFILES, get_profile, load_profile, save_profile
from hyperpar.plan.layout import Layout, Run
from hyperpar.plan.memory import memory_per_rank
from hyperpar.plan.model import example_spec
from hyperpar.plan.timing import step_time

SPEC = example_spec("tiny")


def _write(tmp_path, data: dict):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(data))
    return path


def _step(layout: Layout, profile) -> float:
    run = Run(world=layout.world, seq_len=16, global_batch=8, param_dtype="float32")
    return step_time(SPEC, run, layout, profile, memory_per_rank(SPEC, run, layout)).step_s


def test_an_old_profile_with_one_number_per_cost_still_loads(tmp_path) -> None:
    data = PROFILES["h100"].to_json()
    data.update({k: 1e-3 * (i + 1) for i, k in enumerate(GROUP_COSTS)})
    prof = load_profile(_write(tmp_path, data))
    for i, key in enumerate(GROUP_COSTS):
        assert getattr(prof, key) == pytest.approx(1e-3 * (i + 1))
        # one number: every group size pays it
        assert [prof.fixed_cost(key, n) for n in (1, 2, 4, 8, 1024)] == \
            [pytest.approx(1e-3 * (i + 1))] * 5


def test_a_profile_without_the_group_costs_loads_with_zero(tmp_path) -> None:
    data = PROFILES["a100"].to_json()
    for key in GROUP_COSTS:
        del data[key]
    prof = load_profile(_write(tmp_path, data))
    assert all(prof.fixed_cost(k, 4) == 0.0 for k in GROUP_COSTS)
    assert prof == PROFILES["a100"]


def test_per_size_tables_round_trip(tmp_path) -> None:
    prof = replace(get_profile("h100"), tp_layer_overhead_s={"2": 1e-3, "4": 3e-3},
                   dp_overhead_s={"2": 2e-3}, fsdp_unit_overhead_s=5e-4)
    path = tmp_path / "p.json"
    save_profile(prof, path)
    assert json.loads(path.read_text())["tp_layer_overhead_s"] == {"2": 1e-3, "4": 3e-3}
    assert load_profile(path) == prof
    # integer keys and integer seconds, as a hand-written file may hold, read the same
    data = json.loads(path.read_text())
    data["tp_layer_overhead_s"] = {2: 1e-3, 4: 3e-3}
    data["dp_overhead_s"] = {"2": 0}
    got = load_profile(_write(tmp_path, data))
    assert got.tp_layer_overhead_s == {"2": 1e-3, "4": 3e-3}
    assert got.fixed_cost("dp_overhead_s", 2) == 0.0


@pytest.mark.parametrize("n,expected", [(1, "2"), (2, "2"), (3, "4"), (4, "4"), (5, "4"),
                                        (7, "4"), (8, "16"), (11, "16"), (16, "16"),
                                        (1024, "16")])
def test_lookup_takes_the_nearest_measured_size_on_a_log_scale(n, expected) -> None:
    table = {"2": 1.0, "4": 2.0, "16": 3.0}  # 8: as far from 4 as from 16, the larger
    prof = replace(get_profile("h100"), pp_action_overhead_s=table)
    assert prof.fixed_cost("pp_action_overhead_s", n) == table[expected]


def test_a_tie_goes_to_the_larger_group() -> None:
    # 4 lies as far from 2 as from 8 on a log scale
    prof = replace(get_profile("h100"), tp_root_overhead_s={"2": 1.0, "8": 5.0})
    assert prof.fixed_cost("tp_root_overhead_s", 4) == 5.0
    assert replace(prof, tp_root_overhead_s={}).fixed_cost("tp_root_overhead_s", 4) == 0.0


@pytest.mark.parametrize("value", [{"two": 1e-3}, {"2": "fast"}, {"0": 1e-3}, "1ms", [1e-3],
                                   True, {"2": True}])
def test_a_bad_group_cost_is_refused_naming_the_key(tmp_path, value) -> None:
    data = PROFILES["h100"].to_json()
    data["fsdp_unit_overhead_s"] = value
    with pytest.raises(ValueError, match=r"fsdp_unit_overhead_s must be a number .*map group "
                                         r"sizes to seconds"):
        load_profile(_write(tmp_path, data))


def test_shipped_profiles_keep_one_zero_per_group_cost() -> None:
    for prof in PROFILES.values():
        for key in GROUP_COSTS:
            assert getattr(prof, key) == 0.0 and not isinstance(getattr(prof, key), dict)
        hash(prof)  # still usable as a cache key


@pytest.mark.parametrize("layout,key,size", [
    (Layout(dp_replicate=2, tp=2), "tp_layer_overhead_s", 2),
    (Layout(tp=4), "tp_layer_overhead_s", 4),
    (Layout(dp_shard=2, tp=2), "tp_root_overhead_s", 2),
    (Layout(dp_shard=2, tp=2), "fsdp_unit_overhead_s", 2),
    (Layout(dp_shard=4), "fsdp_unit_overhead_s", 4),
    (Layout(pp=2, dp_shard=2, microbatches=2), "pp_action_overhead_s", 2),
    (Layout(pp=2, dp_replicate=2, microbatches=2), "dp_overhead_s", 2),
    (Layout(dp_replicate=4), "dp_overhead_s", 4),
    (Layout(cp=2), "cp_layer_overhead_s", 2),
    (Layout(cp=4), "cp_layer_overhead_s", 4),
    (Layout(dp_replicate=2, cp=2), "cp_layer_overhead_s", 2),
    # data_parallel averages the gradients over the replicas and the cp ranks together
    (Layout(dp_replicate=2, cp=2), "dp_overhead_s", 4),
], ids=lambda x: x.name if isinstance(x, Layout) else str(x))
def test_step_time_pays_the_cost_of_the_layouts_group_size(layout, key, size) -> None:
    base = PROFILES["h100"]
    table = replace(base, **{key: {"2": 1e-3, "4": 7e-3}})
    scalar = replace(base, **{key: {"2": 1e-3, "4": 7e-3}[str(size)]})
    other = replace(base, **{key: {"2": 7e-3, "4": 1e-3}[str(size)]})
    # the table's entry for this layout's group size, and no other, is what the step pays
    assert _step(layout, table) == pytest.approx(_step(layout, scalar), rel=1e-12)
    assert _step(layout, table) != pytest.approx(_step(layout, other), rel=1e-6)
    assert _step(layout, table) > _step(layout, base)


def _times(layout: Layout, world: int, profile):
    run = Run(world=world, seq_len=16, global_batch=8, param_dtype="float32",
              gpus_per_node=world)
    return step_time(SPEC, run, layout, profile, memory_per_rank(SPEC, run, layout))


@pytest.mark.parametrize("cores,ranks_busy_share", [(0, 1.0), (4, 1.0), (2, 0.5), (1, 0.5)])
def test_pipeline_ramp_slots_run_on_the_cores_waiting_stages_free(cores, ranks_busy_share
                                                                   ) -> None:
    # 4 ranks, pp 2: in a ramp slot half of them wait. With a core each (or a device each:
    # cores 0) a ramp slot costs a full one; on 2 cores the busy half gets a core each and
    # runs twice as fast as when all 4 share them; on 1 core still twice as fast (2 share it)
    prof = replace(get_profile("h100"), layer_overhead_s=1e-3, pp_action_overhead_s=1e-3,
                   cores=cores)
    layout = Layout(pp=2, dp_replicate=2, microbatches=4)
    t = _times(layout, 4, prof)
    full = _times(layout, 4, replace(prof, cores=0))
    assert full.bubble_s == pytest.approx((full.step_s - full.dp_exposed_s
                                           - full.optimizer_s) / 5, rel=1e-9)
    assert t.bubble_s == pytest.approx(ranks_busy_share * full.bubble_s, rel=1e-9)
    assert t.step_s == pytest.approx(full.step_s - full.bubble_s + t.bubble_s, rel=1e-9)
    # no pipeline: nothing waits, nothing changes
    assert _times(Layout(dp_replicate=4), 4, prof).step_s == \
        _times(Layout(dp_replicate=4), 4, replace(prof, cores=0)).step_s


@pytest.mark.parametrize("value", [-1, "2", True, None])
def test_bad_cores_in_a_profile_is_refused(tmp_path, value) -> None:
    data = PROFILES["h100"].to_json()
    data["cores"] = value
    with pytest.raises(ValueError, match="cores must be a number >= 0"):
        load_profile(_write(tmp_path, data))


def test_node_topology_sets_the_inter_node_share() -> None:
    from hyperpar.plan.cli import parse_rate
    from hyperpar.plan.devices import get_profile, with_topology
    from hyperpar.plan.layout import Layout, Run
    from hyperpar.plan.timing import link_for

    assert parse_rate("400Gb/s") == 50e9 and parse_rate("400Gbit/s") == 50e9
    assert parse_rate("50GB/s") == 50e9 and parse_rate("5e10") == 5e10
    h100 = get_profile("h100")
    assert with_topology(h100, gpus_per_node=8) is h100
    four = with_topology(h100, gpus_per_node=8, nics_per_node=4)
    assert four.inter_bytes_per_s == 4 * h100.inter_bytes_per_s / 8
    fast = with_topology(h100, gpus_per_node=8, nics_per_node=8, nic_bytes_per_s=parse_rate(
        "800Gb/s"), intra_bytes_per_s=900e9)
    assert fast.inter_bytes_per_s == 100e9 and fast.intra_bytes_per_s == 900e9
    run = Run(world=64, seq_len=2048, global_batch=64)
    lay = Layout(dp_shard=64)
    # 8 members of the group per node share the node's 4 NICs of 50 GB/s: 200 GB/s per ring
    assert link_for("dp_shard", lay, run, four).bytes_per_s == 8 * 25e9 * h100.link_efficiency
    with pytest.raises(ValueError, match="must be positive"):
        with_topology(h100, gpus_per_node=8, nics_per_node=0)


def test_a_ring_across_nodes_uses_its_members_share_of_the_nics() -> None:
    """Hand-computed: A100 (25 GB/s per device, NVLink 300 GB/s), 8 devices per node. A ring
    with g members per node gets min(300, g x 25) GB/s; one member per node (tp8 inside) 25."""
    from hyperpar.plan.devices import get_profile
    from hyperpar.plan.layout import Layout, Run
    from hyperpar.plan.timing import link_for, ranks_per_node

    a100 = get_profile("a100")
    eff = a100.link_efficiency
    run = Run(world=64, seq_len=2048, global_batch=64)
    assert ranks_per_node("dp_shard", Layout(dp_shard=64), run) == 8
    assert link_for("dp_shard", Layout(dp_shard=64), run, a100).bytes_per_s == 200e9 * eff
    lay = Layout(dp_shard=32, tp=2)  # stride 2: 4 members per node
    assert ranks_per_node("dp_shard", lay, run) == 4
    assert link_for("dp_shard", lay, run, a100).bytes_per_s == 100e9 * eff
    lay = Layout(dp_shard=8, tp=8)  # one member per node: one device's NIC
    assert link_for("dp_shard", lay, run, a100).bytes_per_s == 25e9 * eff
    assert link_for("tp", lay, run, a100).bytes_per_s == 300e9 * eff  # inside the node
    # fully_shard over the flattened dp_shard x cp group: 16 x 4 members, cp's stride (tp 1)
    # apart: 8 per node
    flat = Layout(dp_shard=16, cp=4)
    assert ranks_per_node("dp_shard", flat, run) == 8
    assert link_for("dp_shard", flat, run, a100).bytes_per_s == 200e9 * eff
    fat = Run(world=64, seq_len=2048, global_batch=64, gpus_per_node=16)
    # 16 members per node: 400 GB/s of NICs, capped by the 300 GB/s NVLink hops
    assert link_for("dp_shard", Layout(dp_shard=64), fat, a100).bytes_per_s == 300e9 * eff


def test_elementwise_ops_are_priced_as_hbm_traffic() -> None:
    """Hand-computed: a Llama block (h 64, f 128, 4 heads, no GQA), one rank, 2 layers, a
    microbatch of 2 x 16 tokens in bf16. Per token a layer keeps (3q + 3kv + 4f) + 4h =
    192 + 192 + 512 + 256 = 1152 elements, 2304 bytes; 32 tokens: 73,728 bytes per layer; 5
    passes x 2 layers x 1 microbatch = 737,280 bytes at 1e12 B/s. Full checkpointing adds 2
    passes (7); a calibrated profile (elementwise_hbm off) prices nothing."""
    from dataclasses import replace

    from hyperpar.plan.devices import get_profile
    from hyperpar.plan.layout import Layout, Run
    from hyperpar.plan.model import example_spec
    from hyperpar.plan.timing import elementwise_seconds

    spec = example_spec("llama")
    run = Run(world=1, seq_len=16, global_batch=2)
    prof = replace(get_profile("a100"), hbm_bytes_per_s=1e12)
    assert elementwise_seconds(spec, run, Layout(), prof) == pytest.approx(737_280 / 1e12)
    ac = Layout(activation_checkpointing=True)
    assert elementwise_seconds(spec, run, ac, prof) == pytest.approx(7 * 147_456 / 1e12)
    off = replace(prof, elementwise_hbm=False)
    assert elementwise_seconds(spec, run, Layout(), off) == 0.0


def test_attention_flops_count_flash_attentions_recomputed_scores() -> None:
    """Hand-computed: examples/llama (h 64, 2 layers, q_dim 64, 256 vocabulary; matmul
    parameters 2 x 40,960 + 16,384 = 98,304), 2 sequences of 16 tokens (32 tokens). Matmuls:
    6 x 98,304 x 32 = 18,874,368. Attention forward: 2 x 16 x 64 x 2 layers = 4,096 per token,
    131,072 in all; flash: 3.5 of them (forward 1, backward 2.5: Q K^T again), eager 3, full
    checkpointing one forward more."""
    from dataclasses import replace

    from hyperpar.plan.layout import Run
    from hyperpar.plan.model import example_spec
    from hyperpar.plan.timing import step_flops

    spec = example_spec("llama")
    run = Run(world=1, seq_len=16, global_batch=2)
    assert spec.matmul_parameters == 98_304
    assert step_flops(spec, run, False) == 18_874_368 + 3.5 * 131_072
    assert step_flops(spec, replace(run, attention="eager"), False) == 18_874_368 + 3 * 131_072
    assert step_flops(spec, run, True) == 8 * 98_304 * 32 + 4.5 * 131_072
