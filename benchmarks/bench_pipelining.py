"""torch.distributed.pipelining schedules on hyperpar vs on torch: step time, side by side.

    python benchmarks/bench_pipelining.py [--ranks 2] [--microbatches 8] [--dim 256]
                                          [--steps 6] [--json rows.json]

Spawns ``--ranks`` processes (one thread each). For each schedule -- ``Schedule1F1B`` (two MLP
blocks per stage, one stage per rank), ``ScheduleInterleaved1F1B``, ``ScheduleZBVZeroBubble`` and
``ScheduleInterleavedZeroBubble`` (one block per stage, two stages per rank) -- the same script
is built once with ``torch.distributed.pipelining`` and once with ``hyperpar.pipelining`` on the
same weights and microbatches, and the two are timed round-robin (one step of each per round),
so load changes on a shared machine hit both alike. A step's time is the slowest rank's.

The zero-bubble schedules split each backward into the input gradient and the weight gradient;
whether that pays depends on the machine: on CPU ranks every action competes for the same cores,
so the bubble it removes is small against the extra autograd calls. Read the ratios, not the
absolute times. ``--json PATH`` writes one row per schedule (``hyperpar bench``'s contract).
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import time

import torch
from models import Block  # the script's folder is on sys.path
from torch import nn

SCHEDULES = {  # name -> stages per rank
    "Schedule1F1B": 1,
    "ScheduleInterleaved1F1B": 2,
    "ScheduleZBVZeroBubble": 2,
    "ScheduleInterleavedZeroBubble": 2,
}


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


def _stage_indices(name: str, rank: int, p: int, v: int) -> list[int]:
    if name == "ScheduleZBVZeroBubble":   # a V: down the ranks and back up
        return [rank, 2 * p - 1 - rank]
    return [rank + i * p for i in range(v)]


def worker(dim: int, batch: int, m: int, steps: int, warmup: int) -> dict:
    """Build both libraries' version of every schedule, then time them round-robin."""
    from hyperpar.platform import get_platform

    platform = get_platform()
    p, rank = platform.world_size(), platform.rank()
    device = platform.device()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, dim, generator=g)
    y = torch.randn(batch, dim, generator=g)
    runners, times = {}, {}
    for name, v in SCHEDULES.items():
        n_stages = p * v
        blocks_per_stage = 2 // v
        for lib in ("torch.distributed.pipelining", "hyperpar.pipelining"):
            pp = importlib.import_module(lib)
            torch.manual_seed(0)
            model = nn.ModuleList(
                nn.Sequential(*[Block(dim) for _ in range(blocks_per_stage)])
                for _ in range(n_stages))
            indices = _stage_indices(name, rank, p, v)
            stages = [pp.PipelineStage(model[i], i, n_stages, device) for i in indices]
            sched = getattr(pp, name)(stages[0] if v == 1 else stages, m, loss_fn=mse)
            first, last = 0 in indices, n_stages - 1 in indices
            key = f"{name} ({'torch' if lib.startswith('torch') else 'hyperpar'})"

            def step(model=model, sched=sched, first=first, last=last) -> None:
                model.zero_grad(set_to_none=True)
                sched.step(*((x,) if first else ()), target=y if last else None,
                           losses=[] if last else None)

            runners[key], times[key] = step, []
    for _ in range(warmup + steps):
        for key, fn in runners.items():
            platform.barrier()
            t0 = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t0)
    return {key: ts[warmup:] for key, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", dest="json_path", default=None,
                        help="write hyperpar bench rows (JSON list) to this file")
    args = parser.parse_args()
    from hyperpar.testing import run_distributed

    p, m = args.ranks, args.microbatches
    if p < 2:
        print(f"pipelining benchmark: skipped: a pipeline needs 2 or more ranks (--ranks {p})")
        if args.json_path:
            with open(args.json_path, "w") as fp:
                json.dump([], fp)
        return
    results = run_distributed(worker, p, args.dim, args.batch, m, args.steps, args.warmup,
                              timeout_s=600)
    med = {key: statistics.median(max(ts) for ts in zip(*[r[key] for r in results],
                                                            strict=True))
           for key in results[0]}
    print(f"pipelining benchmark: {p} ranks x 1 thread, {2 * p} MLP blocks (dim {args.dim}), "
          f"batch {args.batch}, {m} microbatches, median of {args.steps} steps")
    header = f"{'schedule':<32} {'torch ms':>9} {'hyperpar ms':>12} {'hyperpar/torch':>15}"
    print(header)
    print("-" * len(header))
    rows = []
    for name in SCHEDULES:
        t, h = med[f"{name} (torch)"], med[f"{name} (hyperpar)"]
        print(f"{name:<32} {t * 1e3:>9.1f} {h * 1e3:>12.1f} {h / t:>15.2f}")
        rows.append({"benchmark": "pipelining",
                     "case": f"{name} step, {p} ranks, {m} microbatches, {2 * p} MLP blocks "
                             f"dim {args.dim}",
                     "hyperpar_ms": h * 1e3, "reference": f"torch {name}",
                     "reference_ms": t * 1e3, "ratio": h / t})
    one = med["Schedule1F1B (hyperpar)"]
    for name in ("ScheduleZBVZeroBubble", "ScheduleInterleavedZeroBubble"):
        print(f"hyperpar {name} / hyperpar Schedule1F1B: "
              f"{med[f'{name} (hyperpar)'] / one:.2f}x")
    if args.json_path:
        with open(args.json_path, "w") as fp:
            json.dump(rows, fp, indent=2)


if __name__ == "__main__":
    main()
