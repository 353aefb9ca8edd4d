"""Measure this machine's device profile (``hyperpar bench --write-profile FILE``,
``hyperpar plan --measure --save-profile FILE``): the rates *and* the fixed costs that dominate
small models.

On ``ranks`` processes of the selected backend (all busy at once, as in a real run):

1. microbenchmarks: matmul FLOP/s (also per width, 8 to 1024), memory bandwidth, a large
   all-reduce's bandwidth, and the fixed cost of one collective (all-gather, reduce-scatter,
   all-reduce of one element per rank; their median) for every group size dividing ``ranks``;
2. a micro model -- the example Llama at width 8 -- run for real in a few layouts, each fixed
   cost taken as what is left of the measured forward + backward once the planner's own
   prediction *without* that cost is subtracted, divided by how often it occurs:

   * alone (every rank its own model, 1 and 3 layers): ``layer_overhead_s`` (the slope),
     ``root_overhead_s`` (the rest), ``optimizer_tensor_overhead_s``;
   * alone, a 128-wide model (the one run whose FLOPs count): ``compute_efficiency``, the
     share of the matmul microbenchmark's rate a training step reaches;
   * for every group size ``n`` dividing ``ranks`` (``ranks / n`` independent copies of the
     layout side by side, every process busy as in a real run), one table entry per size:
     fully_shard over ``n``: ``fsdp_unit_overhead_s`` (per unit; over all ranks also
     ``sharded_optimizer_tensor_overhead_s``); tensor parallel over ``n``, 1 and 3 layers:
     ``tp_layer_overhead_s`` (per layer, the slope), ``tp_root_overhead_s`` (the embedding,
     head and loss under tp); data_parallel over ``n``: ``dp_overhead_s`` (per step); a
     pipeline of ``n`` stages: ``pp_action_overhead_s`` (per forward or backward action);
     context parallel over ``n``, 1 and 3 layers: ``cp_layer_overhead_s`` (per layer, the
     slope).

The micro model's FLOPs are negligible, so what is measured there is fixed cost, not compute;
the models ``--measure`` and benchmarks/plan_validation.py validate against are different
(32 and 256 wide). Imports torch when it runs.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import replace
from typing import Any

from .devices import GROUP_COSTS, DeviceProfile
from .layout import Layout, Run
from .memory import memory_per_rank
from .model import spec_from_model_args
from .timing import step_time

#: The micro model: FLOPs negligible, every component present (heads divisible up to 4 ranks).
MICRO = {"vocab_size": 8, "dim": 8, "n_layers": 1, "n_heads": 4, "ffn_hidden": 8}
MICRO_SEQ = 4
#: A model wide enough to compute (between the examples' tiny and wide validation models).
MID = {"vocab_size": 512, "dim": 128, "n_layers": 2, "n_heads": 4, "ffn_hidden": 512}
MID_SEQ, MID_BATCH = 64, 2
#: Matmul widths whose FLOP/s are measured (small ones run far below the peak).
MATMUL_SIZES = (8, 16, 32, 64, 128, 256, 512, 1024)


def _micro_worker(size: int, repeats: int) -> dict[str, Any]:
    import torch

    from hyperpar.platform import get_platform

    pf = get_platform()
    world, rank = pf.world_size(), pf.rank()
    # per-call medians: a shared machine's preemptions fall out, this run's own ranks
    # (all multiplying at once) stay in
    def matmul_rate(n: int, reps: int) -> float:
        a, b = torch.randn(n, n), torch.randn(n, n)
        for _ in range(3):
            a @ b
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - start)
        return 2 * n**3 / statistics.median(times)

    pf.barrier()
    flops = matmul_rate(size, repeats)
    by_size = {str(n): matmul_rate(n, repeats) for n in MATMUL_SIZES}
    big = torch.randn(2**22)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        big.mul_(1.0)
        times.append(time.perf_counter() - start)
    mem_bw = 2 * big.numel() * 4 / statistics.median(times)

    def timed(fn: Any, n: int) -> float:
        fn()
        pf.barrier()
        times = []
        for _ in range(n):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    latency: dict[str, float] = {}
    for n in range(2, world + 1):
        if world % n:
            continue
        groups = [pf.new_group(list(range(g, g + n))) for g in range(0, world, n)]
        latency[str(n)] = _latency(pf, timed, groups[rank // n], n, repeats)
    large = torch.zeros(2**20)
    t_large = timed(lambda: pf.all_reduce(large), 5)
    wire = 2 * (world - 1) / world * large.numel() * 4
    bw = wire / max(t_large - latency[str(world)], 1e-9)
    return {"flops": flops, "mem_bw": mem_bw, "bw": bw, "latency": latency,
            "by_size": by_size}


def _latency(pf: Any, timed: Any, group: Any, n: int, repeats: int) -> float:
    """Median fixed cost of an all-gather, a reduce-scatter and an all-reduce of one element
    per rank over ``group``."""
    import torch

    one, out = torch.zeros(1), torch.zeros(n)
    costs = [timed(lambda: pf.all_gather_into_tensor(out, one, group=group), repeats),
             timed(lambda: pf.reduce_scatter_tensor(one, out, group=group), repeats),
             timed(lambda: pf.all_reduce(one, group=group), repeats)]
    return statistics.median(costs)


def _cores() -> int:
    """CPU cores this process (and the workers it starts) may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _fb_s(got: list[dict[str, float]]) -> float:
    """Forward + backward of the slowest rank, seconds."""
    return max(r["fb_ms"] for r in got) / 1e3


def _predicted_fb_s(profile: DeviceProfile, layout: Layout, sizes: dict[str, int],
                    batch: int, seq: int = MICRO_SEQ, replicas: int = 1) -> float:
    """The planner's forward + backward for ``layout``, one of ``replicas`` copies running
    side by side (each copy gets its share of the cores)."""
    if replicas > 1 and profile.cores:
        profile = replace(profile, cores=profile.cores / replicas)
    spec = spec_from_model_args(sizes)
    run = Run(world=layout.world, seq_len=seq, global_batch=batch,
              param_dtype="float32", gpus_per_node=layout.world)
    mem = memory_per_rank(spec, run, layout)
    t = step_time(spec, run, layout, profile, mem)
    return t.step_s - t.optimizer_s


def group_sizes(ranks: int) -> list[int]:
    """The group sizes a calibration on ``ranks`` processes measures: every divisor >= 2."""
    return [n for n in range(2, ranks + 1) if ranks % n == 0]


def _put(prof: DeviceProfile, key: str, n: int, value: float) -> DeviceProfile:
    """``prof`` with group fixed cost ``key`` for groups of ``n`` set to ``value`` (>= 0)."""
    table = dict(getattr(prof, key)) if isinstance(getattr(prof, key), dict) else {}
    table[str(n)] = max(0.0, value)
    return replace(prof, **{key: table})


def _group_costs(prof: DeviceProfile, run: Any, n: int, replicas: int) -> DeviceProfile:
    """Measure the group fixed costs for groups of ``n`` ranks (``replicas`` copies of each
    layout side by side); ``prof`` must hold 0 for size ``n`` in each of them."""
    def fb(lay: Layout, sizes: dict[str, int], batch: int) -> float:
        return _fb_s(run(lay, sizes, batch, replicas=replicas))

    # fully_shard over n: per unit (every layer and the root)
    lay = Layout(dp_shard=n)
    got = run(lay, MICRO, n, replicas=replicas)
    unit = (_fb_s(got) - _predicted_fb_s(prof, lay, MICRO, n)) / 2
    prof = _put(prof, "fsdp_unit_overhead_s", n, unit)
    if replicas == 1:  # the optimizer's per-DTensor cost: once, over every rank
        opt_sharded = max(r["opt_ms"] for r in got) / 1e3 / (9 + 3)
        prof = replace(prof, sharded_optimizer_tensor_overhead_s=opt_sharded)
    # tensor parallel over n, 1 and 3 layers: per layer (the slope) and at the embedding /
    # head / loss (the rest)
    lay = Layout(tp=n)
    three_l = {**MICRO, "n_layers": 3}
    res1 = fb(lay, MICRO, 1) - _predicted_fb_s(prof, lay, MICRO, 1)
    res3 = fb(lay, three_l, 1) - _predicted_fb_s(prof, lay, three_l, 1)
    tp_layer = max(0.0, (res3 - res1) / 2)
    prof = _put(prof, "tp_layer_overhead_s", n, tp_layer)
    prof = _put(prof, "tp_root_overhead_s", n, res1 - tp_layer)
    # context parallel over n, 1 and 3 layers: per layer (the slope); the sequence splits
    # into 2n head-tail chunks
    lay = Layout(cp=n)
    seq = 2 * n * MICRO_SEQ
    res1 = (_fb_s(run(lay, MICRO, 1, seq=seq, replicas=replicas))
            - _predicted_fb_s(prof, lay, MICRO, 1, seq))
    res3 = (_fb_s(run(lay, three_l, 1, seq=seq, replicas=replicas))
            - _predicted_fb_s(prof, lay, three_l, 1, seq))
    prof = _put(prof, "cp_layer_overhead_s", n, (res3 - res1) / 2)
    # data_parallel over n: per step
    lay = Layout(dp_replicate=n)
    dp = fb(lay, MICRO, n) - _predicted_fb_s(prof, lay, MICRO, n)
    prof = _put(prof, "dp_overhead_s", n, dp)
    # a pipeline of n stages, one layer each: per forward or backward action (how many the
    # prediction charges, ramp slots at their speed, is read off the prediction itself)
    lay = Layout(pp=n, microbatches=n)
    sizes = {**MICRO, "n_layers": n}
    base = _predicted_fb_s(prof, lay, sizes, n, replicas=replicas)
    actions = _predicted_fb_s(_put(prof, "pp_action_overhead_s", n, 1.0), lay, sizes, n,
                              replicas=replicas) - base
    action = (fb(lay, sizes, n) - base) / actions
    return _put(prof, "pp_action_overhead_s", n, action)


def calibrate(ranks: int = 2, *, steps: int = 30, warmup: int = 3, pool: Any = None,
              log: Any = None) -> DeviceProfile:
    """Measure a profile on ``ranks`` processes (see the module docstring). ``pool``: a
    :class:`hyperpar.testing.WorkerPool` of ``ranks`` processes to reuse."""
    from hyperpar.testing import WorkerPool

    from ._runs import run_layout

    own = pool is None
    if own:
        pool = WorkerPool(ranks, collective_timeout_s=300).__enter__()
    try:
        def run(lay: Layout, sizes: dict[str, int], batch: int, alone: bool = False,
                seq: int = MICRO_SEQ, replicas: int = 1) -> list[dict[str, float]]:
            fields = {k: getattr(lay, k) for k in ("dp_replicate", "dp_shard", "tp", "pp", "cp",
                                                    "microbatches", "schedule")}
            return pool.run(run_layout, sizes, fields, seq, batch, steps, warmup,
                            False, alone, replicas, timeout_s=300)

        micro = pool.run(_micro_worker, 384, 20, timeout_s=300)[0]
        prof = DeviceProfile(
            name=f"this machine, {ranks} processes (measured)", flops_bf16=micro["flops"],
            flops_fp32=micro["flops"], memory_bytes=16 * 2**30,
            hbm_bytes_per_s=micro["mem_bw"], intra_bytes_per_s=micro["bw"],
            inter_bytes_per_s=micro["bw"], intra_alpha_s=micro["latency"][str(ranks)],
            inter_alpha_s=micro["latency"][str(ranks)], compute_efficiency=1.0,
            link_efficiency=1.0, collective_latency_s=micro["latency"],
            matmul_flops_by_size=micro["by_size"], comm_overlap=0.0, cores=_cores(),
            source="measured by hyperpar calibrate")
        # alone: 1 and 3 layers -> per-layer slope and the root's fixed cost
        one = run(Layout(), MICRO, 1, alone=True)
        three = run(Layout(), {**MICRO, "n_layers": 3}, 1, alone=True)
        layer = max(0.0, (_fb_s(three) - _fb_s(one)) / 2)
        prof = replace(prof, layer_overhead_s=layer)
        root = max(0.0, _fb_s(one) - _predicted_fb_s(prof, Layout(), MICRO, 1))
        opt_plain = max(r["opt_ms"] for r in three) / 1e3
        tensors_3 = 3 * 9 + 3
        prof = replace(prof, root_overhead_s=root,
                       optimizer_tensor_overhead_s=opt_plain / tensors_3)
        # a model wide enough to compute: which share of the matmul microbenchmark's rate a
        # training step reaches (the rest: attention scores, elementwise ops, the optimizer)
        zero = replace(prof, compute_efficiency=1.0)
        got = run(Layout(), MID, MID_BATCH, alone=True, seq=MID_SEQ)
        spec = spec_from_model_args(MID)
        mid_run = Run(world=1, seq_len=MID_SEQ, global_batch=MID_BATCH, param_dtype="float32")
        mem = memory_per_rank(spec, mid_run, Layout())
        t = step_time(spec, mid_run, Layout(), zero, mem)
        compute = t.compute_s
        fixed = t.step_s - t.optimizer_s - compute
        eff = compute / max(_fb_s(got) - fixed, compute)
        prof = replace(prof, compute_efficiency=eff)
        # the group fixed costs, for every group size n dividing ``ranks``: ranks / n
        # independent copies of each layout side by side, so that the cores are as busy as in
        # a real run whose groups of n share them (a 4-rank dp2 x tp2 run's tp groups of 2)
        prof = replace(prof, **{k: {str(n): 0.0 for n in group_sizes(ranks)}
                                for k in GROUP_COSTS})
        for n in group_sizes(ranks):
            prof = _group_costs(prof, run, n, ranks // n)
    finally:
        if own:
            pool.__exit__(None, None, None)
    if log:
        log(describe(prof))
    return prof


def write_profile(path: str, ranks: int = 2) -> int:
    """``hyperpar bench --write-profile PATH``: measure, write, say what was measured."""
    from .devices import save_profile

    if ranks < 2:
        print(f"hyperpar bench --write-profile: --ranks must be >= 2 (collectives are part of "
              f"the profile), got {ranks}")
        return 2
    start = time.perf_counter()
    profile = calibrate(ranks)
    save_profile(profile, path)
    print(describe(profile))
    print(f"measured in {time.perf_counter() - start:.0f} s; wrote {path} (use it with "
          f"hyperpar plan --profile {path})")
    return 0


def _ms(value: float | dict[str, float]) -> str:
    """A fixed cost in ms: one figure, or one per group size (``2 ranks 0.40, 4 ranks 1.10``)."""
    if isinstance(value, dict):
        return ", ".join(f"{n} ranks {v * 1e3:.2f}" for n, v in value.items()) + " ms"
    return f"{value * 1e3:.2f} ms"


def describe(p: DeviceProfile) -> str:
    """One paragraph of a measured profile's figures."""
    lat = ", ".join(f"{n} ranks {s * 1e6:.0f} us" for n, s in p.collective_latency_s.items())
    sizes = ", ".join(f"{n}: {f / 1e9:.1f}" for n, f in p.matmul_flops_by_size.items())
    return (f"{p.name}: {p.flops_fp32 / 1e9:.1f} GFLOP/s per process ({p.cores:g} cores), "
            f"{p.compute_efficiency:.0%} "
            f"of it in a training step (by matmul width "
            f"{sizes}), memory "
            f"{p.hbm_bytes_per_s / 1e9:.1f} GB/s, collective bandwidth "
            f"{p.intra_bytes_per_s / 1e9:.2f} GB/s, collective fixed cost {lat}; per layer "
            f"{p.layer_overhead_s * 1e3:.2f} ms, root {p.root_overhead_s * 1e3:.2f} ms, "
            f"tp per layer {_ms(p.tp_layer_overhead_s)}, tp root {_ms(p.tp_root_overhead_s)}, "
            f"cp per layer {_ms(p.cp_layer_overhead_s)}, "
            f"fully_shard per unit {_ms(p.fsdp_unit_overhead_s)}, data_parallel per step "
            f"{_ms(p.dp_overhead_s)}, pipeline per action {_ms(p.pp_action_overhead_s)}, "
            f"optimizer per tensor {p.optimizer_tensor_overhead_s * 1e6:.0f} us (sharded "
            f"{p.sharded_optimizer_tensor_overhead_s * 1e6:.0f} us)")
