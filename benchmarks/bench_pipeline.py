"""Pipeline schedules: step time, measured bubble vs theory, and 1F1B vs torch's Schedule1F1B.

    python benchmarks/bench_pipeline.py [--ranks 2] [--microbatches 8] [--dim 512] [--steps 6]
                                        [--json rows.json]

Spawns ``--ranks`` processes (one thread each) and runs, on the same stack of MLP blocks split
into one stage per rank and the same microbatches:

* hyperpar's GPipe, 1F1B, interleaved 1F1B (2 virtual stages per rank) and zero-bubble;
* ``torch.distributed.pipelining``'s ``Schedule1F1B`` (outside the library, so this benchmark
  may import it).

Measured bubble = 1 - (compute time summed over ranks) / (ranks x step time): time a rank is
not computing -- waiting on a neighbour, or moving data -- as a share of the step. "plan" is the
bubble of the schedule itself: the ranks' measured action durations replayed with free
communication (separates the schedule from transport and machine noise). Theory:
``(p-1)/(m+p-1)`` for GPipe/1F1B, ``(p-1)/(v*m+p-1)`` interleaved, ``(p-1)/(3m+p-1)`` for
zero-bubble with equal forward, input-gradient and weight-gradient costs.

``--json PATH`` writes one row per hyperpar schedule (``hyperpar bench``'s contract): its step
time against torch's ``Schedule1F1B`` on the same blocks, the measured and theoretical bubble
in the case text. A pipeline needs 2 ranks or more: with ``--ranks 1`` (a one-GPU host) the
script says so and writes no rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from models import Block  # the script's folder is on sys.path
from torch import nn

from hyperpar.pipeline import (
    LayerSpec,
    PipelineModule,
    bubble_fraction_theory,
    get_schedule_class,
    timeline,
)


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


def worker(dim: int, blocks_per_rank: int, batch: int, m: int, steps: int, warmup: int
           ) -> dict:
    """Build every schedule, then time them round-robin (one step of each per round), so
    load changes on a shared machine hit all of them alike."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from hyperpar.platform import get_platform

    platform = get_platform()
    p, rank = platform.world_size(), platform.rank()
    device = platform.device()
    n_layers = blocks_per_rank * p
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, dim, generator=g).to(device)
    y = torch.randn(batch, dim, generator=g).to(device)
    runners, out = {}, {}
    for name, v in [("gpipe", 1), ("1f1b", 1), ("interleaved1f1b", 2), ("zerobubble", 1)]:
        module = PipelineModule([LayerSpec(Block, dim) for _ in range(n_layers)],
                                loss_fn=mse, seed_layers=True, virtual_stages=v,
                                partition_method="uniform")
        sched = get_schedule_class(name)(module, m)
        out[name] = {"times": [], "compute": [], "actions": [], "v": v,
                     "stages": module.total_stages}

        def step(module=module, sched=sched, rec=out[name]):
            module.zero_grad(set_to_none=True)
            sched.step(x, target=y)
            rec["compute"].append(sched.last_timings.compute_s)
            rec["actions"].append(sched.last_timings.per_action)

        runners[name] = step

    # torch.distributed.pipelining on the same blocks (same weights) and microbatches
    ref = PipelineModule([LayerSpec(Block, dim) for _ in range(n_layers)], loss_fn=mse,
                         seed_layers=True, partition_method="uniform")
    stage_mod = nn.Sequential(*[ref._funcs[i] for i in ref.stage_layers(rank)])
    stage = PipelineStage(stage_mod, rank, p, device)  # shapes inferred on the first step
    torch_sched = Schedule1F1B(stage, m, loss_fn=mse)
    out["torch Schedule1F1B"] = {"times": [], "compute": [], "actions": [], "v": 1,
                                 "stages": p}

    def torch_step():
        stage_mod.zero_grad(set_to_none=True)
        if rank == 0:
            torch_sched.step(x)
        elif rank == p - 1:
            torch_sched.step(target=y, losses=[])
        else:
            torch_sched.step()

    runners["torch Schedule1F1B"] = torch_step
    for _ in range(warmup + steps):
        for name, fn in runners.items():
            platform.barrier()
            t0 = time.perf_counter()
            fn()
            out[name]["times"].append(time.perf_counter() - t0)
    for rec in out.values():
        for key in ("times", "compute", "actions"):
            rec[key] = rec[key][warmup:]
    return out


def schedule_bubble(per_rank_actions: list, n_stages: int) -> float:
    """Bubble of the plan itself: replay every rank's actions with their measured durations
    and free communication (:func:`hyperpar.pipeline.timeline`)."""
    plans = [[a for a, _ in acts] for acts in per_rank_actions]
    dur = [{a: dt for a, dt in acts} for acts in per_rank_actions]
    times = timeline(plans, n_stages, lambda r, a: dur[r][a])
    makespan = max(end for _, end in times.values())
    busy = sum(sum(d.values()) for d in dur)
    return 1 - busy / (len(plans) * makespan)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--blocks-per-rank", type=int, default=2)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", dest="json_path", default=None,
                        help="write hyperpar bench rows (JSON list) to this file")
    args = parser.parse_args()
    from hyperpar.testing import run_distributed

    p, m = args.ranks, args.microbatches
    if p < 2:
        print(f"pipeline benchmark: skipped: a pipeline needs 2 or more ranks (--ranks {p})")
        if args.json_path:
            with open(args.json_path, "w") as fp:
                json.dump([], fp)
        return
    results = run_distributed(worker, p, args.dim, args.blocks_per_rank, args.batch, m,
                              args.steps, args.warmup, timeout_s=600)
    print(f"pipeline benchmark: {p} ranks x 1 thread, {p * args.blocks_per_rank} MLP blocks "
          f"(dim {args.dim}), batch {args.batch}, {m} microbatches, median of {args.steps} "
          f"steps")
    header = (f"{'schedule':<20} {'step ms':>9} {'bubble':>8} {'plan':>8} {'theory':>8} "
              f"{'bubble/theory':>14} {'plan/theory':>12}")
    print(header)
    print("-" * len(header))
    rows: dict[str, float] = {}
    detail: dict[str, str] = {}
    for name in results[0]:
        v = results[0][name]["v"]
        # per step: slowest rank's wall time; bubble from the ranks' compute time
        per_step = list(zip(*[r[name]["times"] for r in results], strict=True))
        step_t = [max(ts) for ts in per_step]
        med = statistics.median(step_t)
        if results[0][name]["compute"]:
            comp = list(zip(*[r[name]["compute"] for r in results], strict=True))
            bubbles = [1 - sum(c) / (p * t) for c, t in zip(comp, step_t, strict=True)]
            bubble = statistics.median(bubbles)
            plan = statistics.median(
                schedule_bubble(list(acts), results[0][name]["stages"])
                for acts in zip(*[r[name]["actions"] for r in results], strict=True))
            theory = (bubble_fraction_theory(p, 3 * m) if name == "zerobubble"
                      else bubble_fraction_theory(p, m, v))
            print(f"{name:<20} {med * 1e3:>9.1f} {bubble:>8.3f} {plan:>8.3f} {theory:>8.3f} "
                  f"{bubble / theory:>14.2f} {plan / theory:>12.2f}")
            detail[name] = f"bubble {bubble:.3f}, plan {plan:.3f}, theory {theory:.3f}"
        else:
            print(f"{name:<20} {med * 1e3:>9.1f} {'-':>8} {'-':>8} {'-':>8} {'-':>14} "
                  f"{'-':>12}")
        rows[name] = med
    ratio = rows["1f1b"] / rows["torch Schedule1F1B"]
    print(f"\nhyperpar 1F1B / torch Schedule1F1B step time: {ratio:.2f}x "
          f"({'faster' if ratio < 1 else 'slower'} than torch)")
    if args.json_path:
        ref = "torch Schedule1F1B"
        out = [{"benchmark": "pipeline",
                "case": f"{name} step, {p} ranks, {m} microbatches, {p * args.blocks_per_rank} "
                        f"MLP blocks dim {args.dim} ({detail[name]})",
                "hyperpar_ms": rows[name] * 1e3, "reference": ref,
                "reference_ms": rows[ref] * 1e3, "ratio": rows[name] / rows[ref]}
               for name in rows if name != ref]
        with open(args.json_path, "w") as fp:
            json.dump(out, fp, indent=2)


if __name__ == "__main__":
    main()
