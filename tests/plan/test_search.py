"""Search and ruled-out reasons; the pipeline bubble against hyperpar's schedule simulator."""

from __future__ import annotations

import pytest

from hyperpar.plan.devices import get_profile
from hyperpar.plan.layout import Layout, Run
from hyperpar.plan.memory import memory_per_rank
from hyperpar.plan.model import example_spec, from_hf_config
from hyperpar.plan.report import frontier
from hyperpar.plan.search import plan, shape_problems
from hyperpar.plan.timing import step_time

from ._common import LLAMA2_7B

SPEC = from_hf_config(LLAMA2_7B)
H100 = get_profile("h100")


def test_dims_that_do_not_divide_are_named() -> None:
    run = Run(world=6, seq_len=4096, global_batch=12)
    assert "num_attention_heads=32 % tp=3" in "; ".join(shape_problems(SPEC, run,
                                                                       Layout(tp=3, pp=2,
                                                                              microbatches=2)))
    # 32 layers on 3 stages are split unevenly (11, 11, 10 less the first's): no problem
    assert shape_problems(SPEC, run, Layout(dp_shard=2, pp=3, microbatches=3)) == []
    problems = shape_problems(SPEC, Run(world=64, seq_len=4096, global_batch=64),
                              Layout(pp=64, microbatches=64))
    assert any("pp=64 > num_hidden_layers=32" in p for p in problems)
    problems = shape_problems(SPEC, Run(world=8, seq_len=4096, global_batch=12),
                              Layout(dp_shard=8))
    assert any("global_batch=12 % (dp_replicate*dp_shard)=8" in p for p in problems)


def test_out_of_memory_says_by_how_much() -> None:
    run = Run(world=8, seq_len=4096, global_batch=8, device_memory=20 * 2**30)
    result = plan(SPEC, run, H100)
    single = [x for x in result.ruled_out if x.layout == Layout(dp_replicate=8)]
    assert single and single[0].kind == "oom"
    peak = memory_per_rank(SPEC, run, Layout(dp_replicate=8)).peak
    assert f"OOM by {(peak - 20 * 2**30) / 2**30:.2f} GiB" in single[0].reason


def test_every_layout_is_either_ranked_or_ruled_out() -> None:
    run = Run(world=16, seq_len=2048, global_batch=32)
    result = plan(SPEC, run, H100)
    assert result.considered == len(result.ranked) + len(result.ruled_out)
    assert all(c.memory.peak <= run.device_memory for c in result.ranked)
    times = [c.time.step_s for c in result.ranked]
    assert times == sorted(times)


def test_frontier_is_not_dominated() -> None:
    result = plan(SPEC, Run(world=16, seq_len=2048, global_batch=32), H100)
    front = frontier(result)
    assert front
    for f in front:
        assert not any(c.time.step_s < f.time.step_s and c.memory.peak < f.memory.peak
                       for c in result.ranked)


def test_a_model_too_big_for_any_layout_ranks_none() -> None:
    run = Run(world=1, seq_len=4096, global_batch=1, device_memory=2**30)
    result = plan(SPEC, run, H100)
    assert not result.ranked and result.ruled_out[0].kind == "oom"


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("pp,m", [(2, 2), (4, 4), (4, 8)])
def test_pipeline_time_matches_the_schedule_simulator(schedule: str, pp: int, m: int) -> None:
    pytest.importorskip("torch")  # hyperpar.pipeline's package imports torch
    from dataclasses import replace

    from hyperpar.pipeline.schedules import gpipe_plan, one_f_one_b_plan, timeline

    spec = replace(example_spec("llama"), num_layers=8)  # layers for every stage
    run = Run(world=pp, seq_len=64, global_batch=m)
    lay = Layout(pp=pp, microbatches=m, schedule=schedule)  # type: ignore[arg-type]
    # communication free, so the simulator (which ignores it) and the model agree exactly
    free = H100.__class__(**{**H100.to_json(), "intra_alpha_s": 0.0,
                             "intra_bytes_per_s": float("inf")})
    t = step_time(spec, run, lay, free, memory_per_rank(spec, run, lay))
    tau = t.compute_s / m  # one microbatch through one stage, forward + backward
    fn = one_f_one_b_plan if schedule == "1f1b" else gpipe_plan
    plans = [fn(pp, m, r) for r in range(pp)]
    spans = timeline(plans, pp, lambda r, a: tau / 3 if a.kind == "F" else 2 * tau / 3)
    makespan = max(end for _, end in spans.values())
    assert t.step_s - t.optimizer_s == pytest.approx(makespan, rel=1e-9)


def _t(layout, **costs) -> float:
    from dataclasses import replace

    run = Run(world=layout.world, seq_len=64, global_batch=8)
    prof = replace(get_profile("h100"), **costs)
    return step_time(SPEC, run, layout, prof, memory_per_rank(SPEC, run, layout)).step_s


@pytest.mark.parametrize("layout,key,times", [
    # a pipeline repeats a microbatch's fixed costs in every one of its m + pp - 1 slots
    (Layout(pp=2, microbatches=4), "layer_overhead_s", (4 + 2 - 1) * 16),
    (Layout(pp=2, microbatches=4), "pp_action_overhead_s", (4 + 2 - 1) * 2),
    (Layout(pp=2, microbatches=4), "root_overhead_s", 4 + 2 - 1),
    # fully_shard: every layer's unit and the root unit, every microbatch
    (Layout(dp_shard=8, microbatches=2), "fsdp_unit_overhead_s", 2 * (32 + 1)),
    (Layout(tp=8), "tp_layer_overhead_s", 32),
    (Layout(tp=8), "tp_root_overhead_s", 1),
    (Layout(dp_replicate=8), "dp_overhead_s", 1),
    # the optimizer loops over the local tensors: 9 per layer, embedding, norm and head
    (Layout(dp_replicate=8), "optimizer_tensor_overhead_s", 32 * 9 + 3),
    (Layout(dp_shard=8), "sharded_optimizer_tensor_overhead_s", 32 * 9 + 3),
], ids=lambda x: x if isinstance(x, str) else None)
def test_fixed_costs_add_where_they_occur(layout, key, times) -> None:
    assert _t(layout, **{key: 1e-3}) - _t(layout) == pytest.approx(times * 1e-3, rel=1e-9)


def test_measured_collective_latency_replaces_the_ring_alpha() -> None:
    from hyperpar.plan.timing import collectives

    layout = Layout(tp=8)
    run = Run(world=8, seq_len=64, global_batch=8)
    n = sum(c.per_step(1) for c in collectives(SPEC, run, layout, 0))
    ring = _t(layout, intra_alpha_s=0.0)
    # with a measured fixed cost of 1 ms per collective over 8 ranks, every collective on the
    # critical path (all of tp's are) costs exactly that much more
    assert _t(layout, intra_alpha_s=0.0, collective_latency_s={"8": 1e-3}) - ring == \
        pytest.approx(n * 1e-3, rel=1e-9)


def test_compute_runs_at_the_measured_rate_of_the_matmul_size() -> None:
    from dataclasses import replace

    from hyperpar.plan.timing import matmul_size, step_flops

    # measured rates, times the share of them a training step reaches
    # (a measured profile: its elementwise ops are in its fixed costs, not priced apart)
    prof = replace(get_profile("h100"), matmul_flops_by_size={"32": 2e9, "1024": 2e12},
                   compute_efficiency=0.5, elementwise_hbm=False)
    assert prof.flops_at("float32", 16) == 1e9      # below every size: the smallest
    assert prof.flops_at("float32", 4096) == 1e12   # above every size: the largest
    # halfway between 32 and 1024 on a log scale: halfway between their rates
    assert prof.flops_at("float32", (32 * 1024) ** 0.5) == pytest.approx(0.5 * 1.001e12)
    assert get_profile("h100").flops_at("bfloat16", 64) == get_profile("h100").flops("bfloat16")
    # Llama-2-7B under tp 8, 512 tokens a microbatch: 512 x 4096 x 512 per call, the work of
    # a 1024-cube matmul (its narrowest side, 512, would have given 0.5e12)
    run = Run(world=8, seq_len=64, global_batch=8)
    lay = Layout(tp=8)
    assert matmul_size(SPEC, run, lay) == pytest.approx(1024)
    t = step_time(SPEC, run, lay, prof, memory_per_rank(SPEC, run, lay))
    assert t.compute_s == pytest.approx(step_flops(SPEC, run, False) / 8 / 1e12, rel=1e-9)


def test_context_parallel_layouts_are_searched_and_checked() -> None:
    from hyperpar.plan.search import enumerate_layouts

    run = Run(world=8, seq_len=4096, global_batch=8)
    cps = {(x.dp_replicate, x.dp_shard, x.tp, x.pp, x.cp)
           for x in enumerate_layouts(SPEC, run) if x.cp > 1}
    # every dp_replicate x dp_shard x cp with cp > 1, tp = pp = 1
    assert cps == {(4, 1, 1, 1, 2), (2, 2, 1, 1, 2), (1, 4, 1, 1, 2), (2, 1, 1, 1, 4),
                   (1, 2, 1, 1, 4), (1, 1, 1, 1, 8)}
    problems = shape_problems(SPEC, Run(world=8, seq_len=4100, global_batch=8), Layout(cp=8))
    assert any("seq_len=4100 % (2*cp)=16" in p for p in problems)
    # with replicas (dp_shard = 1), 7B's unsharded AdamW states (108 GB) need a large device
    result = plan(SPEC, Run(world=8, seq_len=4096, global_batch=8, device_memory=2**40), H100)
    assert any(c.layout.cp > 1 for c in result.ranked)
    cp8 = next(c for c in result.ranked if c.layout == Layout(cp=8))
    assert cp8.time.comm_bytes["cp"] > 0 and cp8.layout.name.startswith("cp8")


def test_context_parallel_divides_activations_and_adds_gathered_kv() -> None:
    from hyperpar.plan.memory import cp_activation_bytes

    # cp 2 over one 4096-token sequence holds 2048 tokens per rank: as dp on 2048-token
    # sequences, plus the gathered K/V a layer (cp - 1 more copies) and one 2048 x 4096 byte
    # mask shared by the layers
    layout = Layout(dp_replicate=4, cp=2)
    run = Run(world=8, seq_len=4096, global_batch=4, param_dtype="float32")
    per_token, mask = cp_activation_bytes(SPEC, run, layout)
    assert per_token == 2 * SPEC.kv_dim * 4 and mask == 2048 * 4096
    cp = memory_per_rank(SPEC, run, layout)
    dp = memory_per_rank(SPEC, Run(world=8, seq_len=2048, global_batch=8,
                                   param_dtype="float32"), Layout(dp_replicate=8))
    assert cp.states == dp.states
    assert cp.activations == dp.activations + SPEC.num_layers * per_token * 2048 + mask


def test_fully_shard_with_cp_runs_over_the_flattened_dp_shard_x_cp_group() -> None:
    from hyperpar.plan.timing import collectives, cp_link_dim, group_size

    run = Run(world=16, seq_len=4096, global_batch=8)
    layout = Layout(dp_replicate=2, dp_shard=2, cp=4)  # HSDP over (dp_replicate, dp_shard x cp)
    colls = collectives(SPEC, run, layout, 0)
    fsdp = [c for c in colls if c.dim == "dp_shard"]
    assert fsdp and all(group_size(c, layout) == 8 for c in fsdp)
    assert {cp_link_dim(c) for c in fsdp} == {"dp_shard"}
    # its gradients are reduce-scattered by fully_shard: no data_parallel all-reduce on cp, and
    # the replicas all-reduce the 1/8 shard of each unit
    assert [c.kind for c in colls if c.dim == "cp"] == ["ag", "rs"]
    replica = [c for c in colls if c.dim == "dp_replicate"]
    assert replica and all(c.kind == "ar" and c.per == "microbatch" for c in replica)
    block = next(c for c in fsdp if c.what == "layers").nbytes
    # plus one "had a gradient" flag per parameter of the unit (reduce dtype)
    flags = len(SPEC.block_tensors()) * run.reduce_bytes
    assert next(c for c in replica if c.what == "layer grad shards").nbytes == block // 8 + flags
    assert layout.fsdp_shard == 8 and Layout(dp_replicate=2, cp=4).fsdp_shard == 1


@pytest.mark.parametrize("layout,key,n,times", [
    # fully_shard's per-unit fixed cost, looked up at its group's size dp_shard x cp = 8
    (Layout(dp_shard=2, cp=4), "fsdp_unit_overhead_s", "8", 32 + 1),
    # data_parallel's overhead over dp_replicate x cp, only where data_parallel is used
    (Layout(dp_replicate=2, cp=4), "dp_overhead_s", "8", 1),
    (Layout(dp_shard=2, cp=4), "dp_overhead_s", "8", 0),
], ids=lambda x: x if isinstance(x, str) else None)
def test_cp_group_fixed_costs_are_paid_at_their_group_size(layout, key, n, times) -> None:
    # a per-size table with a cost only at the flattened group's size (the nearest measured
    # size to 2 or 4 is 2, charged 0)
    table = {"2": 0.0, n: 1e-3}
    assert _t(layout, **{key: table}) - _t(layout) == pytest.approx(times * 1e-3, rel=1e-9,
                                                                    abs=1e-15)


def test_llama2_7b_on_1024_ranks_has_fully_sharded_cp_layouts_that_fit() -> None:
    run = Run(world=1024, seq_len=4096, global_batch=1024)
    result = plan(SPEC, run, H100)
    cp = [c for c in result.ranked if c.layout.cp > 1]
    # every one that fits is fully sharded: over dp_shard x cp, or over the cp ranks (cpfs)
    assert cp and all(c.layout.fsdp_shard > 1 for c in cp)
    assert any(c.layout.cp_shard for c in cp) and any(c.layout.dp_shard > 1 for c in cp)
    assert all(c.memory.peak <= 80 * 2**30 for c in cp)
    # with replicas only (data_parallel over dp_replicate x cp), every cp layout still runs
    # out of memory
    assert all(x.kind == "oom" for x in result.ruled_out
               if x.layout.cp > 1 and x.layout.fsdp_shard == 1
               and not shape_problems(SPEC, run, x.layout))


def test_uneven_pipeline_stages_126_layers() -> None:
    """Bug (c): Llama 3.1 405B's 126 layers on pp=8 and pp=16 are split as torchtitan splits
    them (one layer less on the first and last stage), not refused."""
    from hyperpar.plan.memory import stage_layers, stage_params
    from hyperpar.plan.model import ModelSpec
    from hyperpar.plan.search import evaluate

    assert [stage_layers(126, 8, s) for s in range(8)] == [15] + [16] * 6 + [15]
    assert [stage_layers(126, 16, s) for s in range(16)] == [7] + [8] * 14 + [7]
    assert [stage_layers(10, 4, s) for s in range(4)] == [2, 3, 3, 2]
    assert [stage_layers(11, 4, s) for s in range(4)] == [2, 3, 3, 3]
    for layers, pp in ((126, 8), (126, 16), (7, 3), (32, 5)):
        assert sum(stage_layers(layers, pp, s) for s in range(pp)) == layers
    spec = ModelSpec("llama-3.1-405b", 16384, 53248, 126, 128, 8, 128256)
    run = Run(world=512, seq_len=8192, global_batch=64)
    layout = Layout(dp_shard=8, tp=8, pp=8, microbatches=8)
    got = evaluate(spec, run, layout, get_profile("h100"))
    assert got.memory is not None  # evaluated, not refused for divisibility
    # the stages' parameters add up to the model's (tp=1, no fsdp: exact counts)
    total = sum(stage_params(spec, 1, 1, 8, s).local for s in range(8))
    assert total == spec.parameters
    first, middle = (stage_params(spec, 1, 1, 8, s).local for s in (0, 1))
    assert middle - first == spec.block_params - spec.vocab_size * spec.hidden_size


def test_layout_names_parse_back() -> None:
    from hyperpar.plan.layout import parse_layout
    from hyperpar.plan.search import enumerate_layouts

    for lay in enumerate_layouts(SPEC, Run(world=16, seq_len=2048, global_batch=32)):
        assert parse_layout(lay.name) == lay


@pytest.mark.parametrize("schedule,v,factor", [
    ("1f1b", 1, 1.0), ("interleaved1f1b", 2, 1 / 2), ("interleaved1f1b", 4, 1 / 4),
    ("zbh1", 1, 1 / 3)])
def test_pipeline_bubble_by_schedule(schedule, v, factor) -> None:
    """The bubble is 1F1B's ``(pp - 1)`` microbatch slots times 1/v (interleaved, Narayanan
    et al. 2021 eq. 2) or 1/3 (ZB-H1 with equal F, B, W passes, Qi et al. 2023)."""
    run = Run(world=8, seq_len=2048, global_batch=16)
    base = Layout(pp=8, microbatches=16)
    lay = Layout(pp=8, microbatches=16, schedule=schedule, virtual_stages=v)
    assert shape_problems(SPEC, run, lay) == []
    one = step_time(SPEC, run, base, H100, memory_per_rank(SPEC, run, base))
    got = step_time(SPEC, run, lay, H100, memory_per_rank(SPEC, run, lay))
    # the pp messages are sent v times over; all else per microbatch is the same
    extra_pp = got.pp_s - one.pp_s
    assert extra_pp == pytest.approx(one.pp_s * (v - 1), rel=1e-9)
    tau = (got.step_s - got.bubble_s - got.optimizer_s - got.dp_exposed_s) / 16
    assert got.bubble_s == pytest.approx(7 * tau * factor, rel=1e-9)


def test_interleaved_first_stage_holds_more_activations() -> None:
    from hyperpar.plan.memory import in_flight

    lay = Layout(pp=4, microbatches=8, schedule="interleaved1f1b", virtual_stages=2)
    assert in_flight(lay, 0) == pytest.approx(4 * (1 + 3 / 8))
    assert in_flight(Layout(pp=4, microbatches=8, schedule="zbh1"), 0) == 4
    run = Run(world=4, seq_len=2048, global_batch=8)
    problems = shape_problems(SPEC, run, Layout(pp=4, microbatches=6,
                                                schedule="interleaved1f1b", virtual_stages=16))
    assert any("microbatches=6 % pp=4" in p for p in problems)
    assert any("pp*virtual_stages=64 > num_hidden_layers=32" in p for p in problems)
    assert any("needs schedule interleaved1f1b" in p
               for p in shape_problems(SPEC, run, Layout(pp=4, microbatches=4,
                                                         virtual_stages=2)))


@pytest.mark.parametrize("schedule", ["interleaved1f1b", "zbh1", "gpipe"])
def test_every_schedule_still_plans_layouts_without_a_pipeline(schedule) -> None:
    run = Run(world=16, seq_len=2048, global_batch=32)
    result = plan(SPEC, run, H100, schedule=schedule)
    assert any(c.layout.pp == 1 for c in result.ranked)
    assert any(c.layout.pp > 1 and c.layout.schedule == schedule for c in result.ranked)


def test_fp32_gradient_reduction_doubles_the_reduced_bytes() -> None:
    from hyperpar.plan.timing import collectives

    bf16 = Run(world=16, seq_len=2048, global_batch=16)
    fp32 = Run(world=16, seq_len=2048, global_batch=16, reduce_dtype="float32")
    for lay in (Layout(dp_replicate=2, dp_shard=8), Layout(dp_replicate=16)):
        a = {c.what: c.nbytes for c in collectives(SPEC, bf16, lay, 0)}
        b = {c.what: c.nbytes for c in collectives(SPEC, fp32, lay, 0)}
        for what in a:
            grads = "grad" in what
            assert b[what] == (2 * a[what] if grads else a[what]), what
        assert any("grad" in w for w in a)


@pytest.mark.parametrize(("pp", "m", "v"), [(8, 8, 2), (4, 8, 2), (4, 12, 3), (8, 32, 2)])
def test_interleaved_in_flight_is_torchs_warmup_per_rank(pp: int, m: int, v: int) -> None:
    """Interleaved 1F1B holds, on rank r, the chunks torch's ScheduleInterleaved1F1B runs in
    warm-up plus one (its ``_get_warmup_ops``, checked where this torch has it), in whole-rank
    units. By hand for torchtitan's Table 5 (pp 8, 8 microbatches, 2 chunks): rank 0 holds
    all 16 chunks (8 microbatches' worth), rank 7 holds 8 + 1 chunks (4.5), where the old
    first-stage factor gave the last rank 1 x (1 + 7/16)."""
    from hyperpar.plan.memory import in_flight

    lay = Layout(pp=pp, microbatches=m, schedule="interleaved1f1b", virtual_stages=v)
    if (pp, m, v) == (8, 8, 2):
        assert [in_flight(lay, r) for r in range(8)] == [8, 8, 8, 8, 7.5, 6.5, 5.5, 4.5]
    if m >= 4 * pp:  # many microbatches: Narayanan et al.'s first-stage factor
        assert in_flight(lay, 0) == pytest.approx(pp * (1 + (pp - 1) / (pp * v)))
    try:
        from torch.distributed.pipelining.schedules import _get_warmup_ops
    except ImportError:  # older torch: the same formula inline in the schedule
        return
    per_round = m // max(1, m // pp)
    for r in range(pp):
        warm = _get_warmup_ops(r, v, per_round, pp, m)
        assert in_flight(lay, r) == min(warm + 1, m * v) / v
