"""Validation of ``hyperpar plan`` against real runs on this machine, and the planner's own speed
at scale. Prints two reports (no assertions; the figures go to docs/planning.md):

1. predicted vs measured, for layouts of the examples' Llama (and a wider one, where compute
   counts) on 2 and 4 ranks of the selected backend, laid out with the real fully_shard /
   parallelize_module / data_parallel / PipelineModule: params + grads + optimizer bytes (the
   model claims exact), peak live tensor bytes (goal: within 10%) and step time (goal: within
   30% on cpu) under a profile measured on the spot (hyperpar.plan.calibrate: rates and fixed
   costs, on a micro model; the group fixed costs per group size), and beside it the step
   time the previous time model (no per-layer cp cost; compute at the rate of a layer's
   narrowest matmul side) predicts on the same profile, against the same measured runs;
2. planner time: Llama-2-7B and Llama-3-70B over growing world sizes, and a model with more
   layers, searched in full.

    python benchmarks/plan_validation.py [--model tiny|wide] [--rounds N] [--worlds 2 4]
        [--only LAYOUT ...] [--skip-measure] [--skip-speed]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hyperpar.plan import from_hf_config, get_profile  # noqa: E402
from hyperpar.plan.layout import Layout, Run  # noqa: E402
from hyperpar.plan.search import plan  # noqa: E402

CONFIGS = ROOT / "examples" / "configs"
LAYOUTS = {2: [Layout(dp_shard=2), Layout(tp=2), Layout(dp_replicate=2),
               Layout(pp=2, microbatches=2), Layout(pp=2, microbatches=4, schedule="gpipe"),
               Layout(dp_shard=2, microbatches=2),
               Layout(dp_shard=2, activation_checkpointing=True),
               Layout(cp=2), Layout(cp=2, activation_checkpointing=True)],
           4: [Layout(dp_shard=4), Layout(dp_shard=2, tp=2), Layout(tp=4),
               Layout(dp_replicate=2, dp_shard=2), Layout(dp_replicate=2, tp=2),
               Layout(pp=2, dp_shard=2, microbatches=2),
               Layout(pp=2, dp_replicate=2, microbatches=2),
               Layout(cp=4), Layout(dp_replicate=2, cp=2), Layout(dp_shard=2, cp=2)]}
MODELS = {
    # examples/llama ModelArgs.tiny(): all fixed costs
    "tiny": ({"vocab_size": 64, "dim": 32, "n_layers": 2, "n_heads": 4, "ffn_hidden": 64},
             16, 8),
    # 4.2M parameters, seq 128: compute is a real share of the step
    "wide": ({"vocab_size": 1024, "dim": 256, "n_layers": 4, "n_heads": 8, "ffn_hidden": 1024},
             128, 8),
}


def previous_model_ms(spec, run, lay, profile, mem) -> float:
    """What the time model before this comparison's change predicts on the same profile: no
    per-layer cp cost, and compute at the rate of the largest measured matmul size <= the
    layer's narrowest side, ``min(hidden / tp, microbatch tokens)``."""
    from dataclasses import replace

    from hyperpar.plan.memory import microbatch_tokens
    from hyperpar.plan.timing import matmul_size, step_time

    t = step_time(spec, run, lay, replace(profile, cp_layer_overhead_s=0.0), mem)
    if not profile.matmul_flops_by_size:
        return t.step_ms
    width = min(spec.hidden_size // lay.tp, microbatch_tokens(run, lay))
    sizes = sorted(int(k) for k in profile.matmul_flops_by_size)
    floor = [k for k in sizes if k <= width] or sizes[:1]
    old_rate = profile.matmul_flops_by_size[str(floor[-1])] * profile.compute_efficiency
    new_rate = profile.flops_at(run.param_dtype, matmul_size(spec, run, lay))
    # compute scales with 1 / rate; nothing else uses it while comm_overlap is 0 (cpu)
    return (t.step_s + t.compute_s * (new_rate / old_rate - 1)) * 1e3


def validate(model: str, rounds: int, worlds: list[int], only: list[str] | None = None) -> None:
    import os
    import statistics

    from hyperpar.plan.calibrate import describe
    from hyperpar.plan.measure import calibrate_cpu, compare
    from hyperpar.plan.memory import memory_per_rank
    from hyperpar.plan.model import spec_from_model_args
    from hyperpar.testing import WorkerPool

    sizes, seq_len, global_batch = MODELS[model]
    spec = spec_from_model_args(sizes)
    print(f"## predicted vs measured: {model} {sizes} ({spec.parameters:,} parameters), seq "
          f"{seq_len}, global batch {global_batch}, fp32, AdamW; {rounds} rounds of "
          "(calibrate, run every layout), medians\n")
    print("| ranks | layout | states predicted (B) | states measured (B) | peak predicted (B) "
          "| peak measured (B) | peak error | step ms predicted | step ms measured "
          "(min-max) | time error | time error, previous model |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    notes = []
    hits = {"peak": 0, "step": 0, "step_before": 0, "n": 0}
    for world in worlds:
        layouts = [lay for lay in LAYOUTS[world] if sizes["n_layers"] % lay.pp == 0
                   and (not only or lay.name in only)]
        run = Run(world=world, seq_len=seq_len, global_batch=global_batch,
                  param_dtype="float32", gpus_per_node=world)
        rows: dict[Layout, list[dict]] = {lay: [] for lay in layouts}
        with WorkerPool(world, collective_timeout_s=600) as pool:
            for i in range(rounds):
                start = time.perf_counter()
                profile = calibrate_cpu(world, pool=pool)
                notes.append(f"calibration, {world} ranks, round {i + 1} "
                             f"({time.perf_counter() - start:.0f} s, load average "
                             f"{os.getloadavg()[0]:.1f}): {describe(profile)}")
                for lay in layouts:
                    row = compare(sizes, lay, run, profile, pool=pool, peak=i == 0)
                    mem = memory_per_rank(spec, run, lay)
                    row["step_ms_before"] = previous_model_ms(spec, run, lay, profile, mem)
                    rows[lay].append(row)
        for lay in layouts:
            r = rows[lay][0]
            pred = statistics.median(x["step_ms_predicted"] for x in rows[lay])
            old = statistics.median(x["step_ms_before"] for x in rows[lay])
            meas = [x["step_ms_measured"] for x in rows[lay]]
            med = statistics.median(meas)
            pe = (r["peak_predicted"] - r["peak_measured"]) / r["peak_measured"]
            te, tb = (pred - med) / med, (old - med) / med
            hits["n"] += 1
            hits["peak"] += abs(pe) <= 0.10
            hits["step"] += abs(te) <= 0.30
            hits["step_before"] += abs(tb) <= 0.30
            print(f"| {world} | {lay.name} | {r['states_predicted']:,} | "
                  f"{r['states_measured']:,} | {r['peak_predicted']:,} | "
                  f"{r['peak_measured']:,} | {pe:+.0%} | {pred:.1f} | {med:.1f} "
                  f"({min(meas):.0f}-{max(meas):.0f}) | {te:+.0%} | {tb:+.0%} ({old:.1f}) |",
                  flush=True)
    print(f"\npeak within 10%: {hits['peak']}/{hits['n']}; step within 30%: "
          f"{hits['step']}/{hits['n']} (previous model: "
          f"{hits['step_before']}/{hits['n']})\n")
    for n in notes:
        print(n + "\n")


def planner_speed() -> None:
    print("## planner time (every layout, this machine)\n")
    print("| model | world | layouts | fit | seconds |")
    print("|---|---|---|---|---|")
    h100 = get_profile("h100")
    cases = [("llama-2-7b", w, 4096, 1024) for w in (64, 256, 1024, 4096)]
    cases += [("llama-3-70b", w, 8192, 2048) for w in (1024, 4096, 16384)]
    for name, world, seq, batch in cases:
        spec = from_hf_config(CONFIGS / f"{name}.json")
        start = time.perf_counter()
        res = plan(spec, Run(world=world, seq_len=seq, global_batch=batch), h100)
        print(f"| {name} | {world} | {res.considered} | {len(res.ranked)} | "
              f"{time.perf_counter() - start:.2f} |", flush=True)
    base = from_hf_config(CONFIGS / "llama-2-7b.json")
    for layers in (32, 64, 128):
        spec = base.__class__(**{**base.__dict__, "num_layers": layers,
                                 "name": f"llama-2-7b x{layers} layers"})
        start = time.perf_counter()
        res = plan(spec, Run(world=1024, seq_len=4096, global_batch=1024), h100)
        print(f"| {spec.name} | 1024 | {res.considered} | {len(res.ranked)} | "
              f"{time.perf_counter() - start:.2f} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", choices=sorted(MODELS))
    p.add_argument("--rounds", type=int, default=3,
                   help="calibrate + measure rounds (the medians damp a shared machine's load)")
    p.add_argument("--worlds", type=int, nargs="+", default=sorted(LAYOUTS),
                   choices=sorted(LAYOUTS), help="world sizes to measure")
    p.add_argument("--only", nargs="+", metavar="LAYOUT",
                   help="measure only these layouts, by name (e.g. cp2.mb1 dp2.mb1)")
    p.add_argument("--skip-measure", action="store_true")
    p.add_argument("--skip-speed", action="store_true")
    args = p.parse_args()
    if not args.skip_measure:
        validate(args.model, args.rounds, args.worlds, args.only)
    if not args.skip_speed:
        planner_speed()


if __name__ == "__main__":
    main()
