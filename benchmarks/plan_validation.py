"""Validation of ``hyperpar plan`` against real runs on this machine's cpu, and the planner's own
speed at scale. Prints two reports (no assertions; the figures go to docs/planning.md):

1. predicted vs measured, for layouts of the examples' Llama on 2 and 4 gloo ranks laid out
   with the real fully_shard / parallelize_module: params + grads + optimizer bytes on rank 0
   (the model claims exact) and step time (goal: within 30% on cpu) under a cpu profile
   calibrated on the spot (matmul FLOP/s, per-layer fixed cost, gloo alpha/beta);
2. planner time: Llama-2-7B and Llama-3-70B over growing world sizes, and a model with more
   layers, searched in full.

    python benchmarks/plan_validation.py [--example tiny|llama] [--skip-measure]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hyperpar.plan import example_spec, from_hf_config, get_profile, memory_per_rank  # noqa: E402
from hyperpar.plan.layout import Layout, Run  # noqa: E402
from hyperpar.plan.search import plan  # noqa: E402
from hyperpar.plan.timing import step_time  # noqa: E402

CONFIGS = ROOT / "examples" / "configs"
LAYOUTS = {2: [Layout(dp_shard=2), Layout(tp=2), Layout(dp_shard=2, microbatches=2),
               Layout(dp_shard=2, activation_checkpointing=True)],
           4: [Layout(dp_shard=4), Layout(dp_shard=2, tp=2), Layout(tp=4)]}


def validate(example: str, seq_len: int, global_batch: int) -> None:
    from hyperpar.plan.measure import calibrate_cpu, measure_layout

    spec = example_spec(example)
    print(f"## predicted vs measured: {spec.name} ({spec.parameters:,} parameters), seq "
          f"{seq_len}, global batch {global_batch}, fp32, AdamW, cpu (gloo)\n")
    print("| ranks | layout | states predicted (B) | states measured (B) | step ms predicted "
          "| step ms measured | time error |")
    print("|---|---|---|---|---|---|---|")
    for world, layouts in LAYOUTS.items():
        run = Run(world=world, seq_len=seq_len, global_batch=global_batch,
                  param_dtype="float32", gpus_per_node=world)
        profile = calibrate_cpu(world)
        for lay in layouts:
            mem = memory_per_rank(spec, run, lay)
            pred = step_time(spec, run, lay, profile, mem)
            got = measure_layout(example, lay, run)
            err = (pred.step_ms - got["step_ms"]) / got["step_ms"]
            print(f"| {world} | {lay.name} | {mem.states:,} | {int(got['states']):,} | "
                  f"{pred.step_ms:.2f} | {got['step_ms']:.2f} | {err:+.0%} |", flush=True)
        print(f"\ncalibrated profile ({world} ranks): {profile.flops_fp32 / 1e9:.1f} GFLOP/s "
              f"per process, layer fixed cost {profile.layer_overhead_s * 1e3:.2f} ms, "
              f"alpha {profile.intra_alpha_s * 1e6:.0f} us, "
              f"{profile.intra_bytes_per_s / 1e9:.2f} GB/s\n")


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
    p.add_argument("--example", default="tiny", choices=("tiny", "llama"))
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--skip-measure", action="store_true")
    p.add_argument("--skip-speed", action="store_true")
    args = p.parse_args()
    if not args.skip_measure:
        validate(args.example, args.seq_len, args.global_batch)
    if not args.skip_speed:
        planner_speed()


if __name__ == "__main__":
    main()
