"""MindSpore backend: pipeline schedules (1F1B, GPipe, zero-bubble) on Cells, measured bubble
vs theory.

    HYPERPAR_BACKEND=mindspore hyperpar run -n 2 benchmarks/bench_ms_pipeline.py
        [--microbatches 8] [--dim 512] [--blocks-per-rank 2] [--micro-batch 64] [--steps 8]

Run in the MindSpore venv (scripts/test-mindspore.sh builds it). ``hyperpar bench`` (torch)
finds this file by its name: without MindSpore it writes no rows and says why. One stage per
rank, a stack of MLP blocks split uniformly, the same microbatches for every schedule; the
schedules are timed alternately, one step each per round, so load on a shared host hits all
alike.

Measured bubble = 1 - (compute time summed over ranks) / (ranks x step time), per step (the
slowest rank's step), median over steps: time a rank is not computing -- waiting on a
neighbour, or moving data -- as a share of the step. "plan" is the bubble of the schedule
itself: the ranks' measured action durations replayed with free communication
(:func:`hyperpar.pipeline.timeline`), which separates the schedule from transport and machine
noise. Theory: ``(p-1)/(m+p-1)``. Goal (issue 32): measured 1F1B bubble <= 1.3x theory where
compute dominates. On MindSpore the backward recomputes the stage forward
(hyperpar_mindspore.pipeline_schedules), so a backward costs about three forwards; the theory
holds for any forward/backward ratio as long as the stages are equal. Zero-bubble's I and W
each re-run the forward too (one more forward per microbatch and stage than 1F1B), so its
compute per rank is larger: compare its step time, not only its bubble; "theory" is 1F1B's.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--blocks-per-rank", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=64, help="rows per microbatch")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if importlib.util.find_spec("mindspore") is None:
        print("bench_ms_pipeline: MindSpore is not installed here; run it in the MindSpore venv "
              "with HYPERPAR_BACKEND=mindspore hyperpar run -n 2 benchmarks/bench_ms_pipeline.py")
        if args.json:
            with open(args.json, "w") as f:
                json.dump([], f)
        return
    rows = run(args)
    if args.json and rows is not None:
        with open(args.json, "w") as f:
            json.dump(rows, f)


def _mse(out, target):
    return ((out - target) ** 2).mean()


def _block_class(dim: int):
    from mindspore import nn

    class Block(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.act = nn.Dense(dim, 4 * dim), nn.GELU()
            self.down = nn.Dense(4 * dim, dim)

        def construct(self, x):
            return x + self.down(self.act(self.up(x)))

    return Block


def _plan_bubble(per_rank_actions: list, n_stages: int) -> float:
    """Bubble of the plan itself: every rank's actions with their measured durations,
    communication free."""
    from hyperpar.pipeline import timeline

    plans = [[a for a, _ in acts] for acts in per_rank_actions]
    dur = [dict(acts) for acts in per_rank_actions]
    times = timeline(plans, n_stages, lambda r, a: dur[r][a])
    makespan = max(end for _, end in times.values())
    busy = sum(sum(d.values()) for d in dur)
    return 1 - busy / (len(plans) * makespan)


def run(args: argparse.Namespace) -> list[dict] | None:
    import mindspore as ms
    import numpy as np

    from hyperpar.pipeline import (
        LayerSpec,
        PipelineModule,
        bubble_fraction_theory,
        get_schedule_class,
    )
    from hyperpar.platform import get_platform

    platform = get_platform()
    platform.init_process_group()
    p, rank = platform.world_size(), platform.rank()
    if p < 2:
        print(f"bench_ms_pipeline: a pipeline needs 2 or more ranks, got {p}")
        return []
    m, dim = args.microbatches, args.dim
    block = _block_class(dim)
    rng = np.random.default_rng(0)
    xs = [ms.Tensor(rng.standard_normal((args.micro_batch, dim)).astype(np.float32))
          for _ in range(m)]
    ys = [ms.Tensor(rng.standard_normal((args.micro_batch, dim)).astype(np.float32))
          for _ in range(m)]
    scheds = {}
    for name in ("1f1b", "gpipe", "zerobubble"):
        ms.set_seed(0)
        module = PipelineModule([LayerSpec(block) for _ in range(args.blocks_per_rank * p)],
                                loss_fn=_mse, partition_method="uniform")
        scheds[name] = get_schedule_class(name)(module, m)
    first, last = 0, p - 1
    rec: dict[str, dict[str, list]] = {n: {"step": [], "compute": [], "actions": []}
                                       for n in scheds}
    for i in range(args.warmup + args.steps):
        for name, sched in scheds.items():
            stage = sched.module.stage_id
            platform.barrier()
            sched.run_microbatches(xs if stage == first else None,
                                   ys if stage == last else None)
            if i >= args.warmup:
                t = sched.last_timings
                rec[name]["step"].append(t.step_s)
                rec[name]["compute"].append(t.compute_s)
                rec[name]["actions"].append(t.per_action)
    everyone = platform.all_gather_object(rec)
    if rank != 0:
        return None
    theory = bubble_fraction_theory(p, m)
    case = (f"{p} stages x {args.blocks_per_rank} MLP blocks ({dim}->{4 * dim}->{dim}), "
            f"{m} microbatches of {args.micro_batch} rows, CPU")
    print(f"MindSpore {ms.__version__}, {case}; median of {args.steps} steps")
    header = (f"{'schedule':<10} {'step ms':>9} {'compute/rank ms':>16} {'bubble':>8} "
              f"{'plan':>7} {'theory':>7} {'bubble/theory':>14} {'plan/theory':>12}")
    print(header)
    print("-" * len(header))
    rows = []
    for name in scheds:
        steps = [max(ts) for ts in zip(*[r[name]["step"] for r in everyone], strict=True)]
        comps = list(zip(*[r[name]["compute"] for r in everyone], strict=True))
        bubble = statistics.median(1 - sum(c) / (p * t) for c, t in zip(comps, steps,
                                                                         strict=True))
        plan = statistics.median(
            _plan_bubble(list(acts), p)
            for acts in zip(*[r[name]["actions"] for r in everyone], strict=True))
        med = statistics.median(steps) * 1e3
        comp = statistics.median(sum(c) / p for c in comps) * 1e3
        print(f"{name:<10} {med:>9.1f} {comp:>16.1f} {bubble:>8.3f} {plan:>7.3f} {theory:>7.3f} "
              f"{bubble / theory:>14.2f} {plan / theory:>12.2f}")
        rows.append({"benchmark": "ms_pipeline",
                     "case": f"{name} step, {case} (bubble {bubble:.3f}, plan {plan:.3f}, "
                             f"theory {theory:.3f}, bubble/theory {bubble / theory:.2f})",
                     "hyperpar_ms": med, "reference": None, "reference_ms": None,
                     "ratio": None})
    print("goal: 1F1B bubble / theory <= 1.3")
    # where a plan above theory comes from: stages that are not equal
    for name in scheds:
        cost = []
        for r, rec_r in enumerate(everyone):
            acts = [a for step in rec_r[name]["actions"] for a in step]
            kinds = sorted({a.kind for a, _dt in acts})   # F and B, or F, I and W
            cost.append(f"stage {r}: " + ", ".join(
                f"{k} {statistics.median(dt for a, dt in acts if a.kind == k) * 1e3:.1f} ms"
                for k in kinds))
        print(f"{name}: per microbatch, median: " + "; ".join(cost))
    sys.stdout.flush()
    return rows


if __name__ == "__main__":
    main()
