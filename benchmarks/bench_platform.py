"""Per-call cost of the platform layer: get_platform().all_reduce vs raw torch.distributed.

Run: ``python benchmarks/bench_platform.py [--ranks 2] [--repeats 200] [--json out.json]``

Both variants run in the same processes, interleaved round by round so that machine noise hits
them alike; each figure is the median over rounds of the per-call time. The ratio is
hyperpar / raw (1.00 = no overhead).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist  # the reference side of the comparison (outside the library)

from hyperpar.platform import get_platform
from hyperpar.testing import run_distributed

SIZES = {"1 KiB": 256, "64 KiB": 16 * 1024, "1 MiB": 256 * 1024, "16 MiB": 4 * 1024 * 1024}


def _time_calls(fn, tensor, calls: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        fn(tensor)
    return (time.perf_counter() - start) / calls


def _measure(repeats: int) -> list[dict]:
    platform = get_platform()
    rows = []
    for label, numel in SIZES.items():
        t = torch.ones(numel)
        calls = max(2, min(20, 20_000_000 // (numel * 8) or 2))
        rounds = max(15, repeats // calls)
        ours, raw = [], []
        for _ in range(2):  # warm-up
            platform.all_reduce(t)
            dist.all_reduce(t)
        for i in range(rounds):  # alternate which variant goes first in a round
            if i % 2:
                raw.append(_time_calls(dist.all_reduce, t, calls))
            ours.append(_time_calls(platform.all_reduce, t, calls))
            if not i % 2:
                raw.append(_time_calls(dist.all_reduce, t, calls))
        h, r = statistics.median(ours) * 1e3, statistics.median(raw) * 1e3
        rows.append({
            "benchmark": "platform", "case": f"all_reduce {label}", "hyperpar_ms": h,
            "reference": "torch.distributed", "reference_ms": r, "ratio": h / r,
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2000)
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args(argv)
    rows = run_distributed(_measure, args.ranks, args.repeats, timeout_s=600)[0]
    backend = get_platform().name
    print(f"platform overhead, {args.ranks} ranks, backend {backend}, torch {torch.__version__}")
    print(f"{'case':<22}{'hyperpar ms':>13}{'raw ms':>11}{'ratio':>8}")
    for row in rows:
        print(f"{row['case']:<22}{row['hyperpar_ms']:>13.4f}{row['reference_ms']:>11.4f}"
              f"{row['ratio']:>8.3f}")
    if args.json_path:
        with open(args.json_path, "w") as fh:
            json.dump(rows, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
