"""MindSpore backend on CPU: reduce-scatter by the point-to-point ring vs by all-reduce + slice.

    HYPERPAR_BACKEND=mindspore hyperpar run -n 2 benchmarks/bench_ms_reduce_scatter.py
        [--reps 20] [--json rows.json]

MindSpore's CPU build has no ReduceScatter kernel. The platform's ``reduce_scatter_tensor``
composes it: below ``RING_MIN_BYTES * n**2`` input bytes as an all-reduce of the whole input
followed by taking this rank's rows, from there on as a ring of ``n - 1`` point-to-point steps
that each move one ``1/n`` block (``hyperpar_mindspore/platform.py``). This script times both
compositions on the same inputs, alternating them rep by rep so load on a shared host hits both
alike, and prints the ratio per size (medians, rank 0's clock, each rep starting at a barrier),
so the threshold can be checked on a new machine. Run it in the MindSpore venv; ``hyperpar
bench`` (torch) finds this file by its name and, without MindSpore, writes no rows and says why.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time

SIZES_KIB = (16, 256, 1024, 4096, 16384)   # whole input, per rank


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if importlib.util.find_spec("mindspore") is None:
        print("bench_ms_reduce_scatter: MindSpore is not installed here; run it in the "
              "MindSpore venv with HYPERPAR_BACKEND=mindspore hyperpar run -n 2 "
              "benchmarks/bench_ms_reduce_scatter.py")
        if args.json:
            with open(args.json, "w") as f:
                json.dump([], f)
        return
    rows = run(args.reps, args.warmup)
    if args.json and rows is not None:
        with open(args.json, "w") as f:
            json.dump(rows, f)


def run(reps: int, warmup: int) -> list[dict] | None:
    import numpy as np
    from mindspore import Tensor

    from hyperpar.platform import get_platform

    platform = get_platform()
    platform.init_process_group()
    n, rank = platform.world_size(), platform.rank()
    if not hasattr(platform, "_ring_reduce_scatter"):
        if rank == 0:
            print(f"bench_ms_reduce_scatter: the {type(platform).__name__} platform has no CPU "
                  f"ring reduce-scatter; set HYPERPAR_BACKEND=mindspore")
        return None
    threshold = getattr(__import__(type(platform).__module__, fromlist=["RING_MIN_BYTES"]),
                        "RING_MIN_BYTES", None)
    rows, lines = [], []
    for kib in SIZES_KIB:
        numel = max(n, (kib * 1024 // 4) // n * n)
        block = numel // n
        x = Tensor(np.random.default_rng(rank).standard_normal(numel).astype(np.float32))

        def ring(x=x, block=block) -> object:
            return platform._ring_reduce_scatter(x, block, "sum", None)

        def via_all_reduce(x=x, block=block) -> object:
            total = x.copy()
            platform.all_reduce(total, "sum", None)
            return total[rank * block:(rank + 1) * block]

        # both compositions give the same rows (a check that cannot be skipped by a fast bug)
        np.testing.assert_allclose(ring().asnumpy(), via_all_reduce().asnumpy(), rtol=1e-5,
                                   atol=1e-5)
        times: dict[str, list[float]] = {"ring": [], "all_reduce": []}
        for i in range(warmup + reps):
            for name, fn in (("ring", ring), ("all_reduce", via_all_reduce)):
                platform.barrier()
                t0 = time.perf_counter()
                fn().asnumpy()   # materialise: MindSpore may run asynchronously
                if i >= warmup:
                    times[name].append(time.perf_counter() - t0)
        r_ms = statistics.median(times["ring"]) * 1e3
        a_ms = statistics.median(times["all_reduce"]) * 1e3
        chosen = "ring" if threshold is not None and numel * 4 >= threshold * n * n else \
            "all-reduce"
        lines.append(f"{kib:>9} KiB {a_ms:>12.2f} {r_ms:>9.2f} {r_ms / a_ms:>12.2f}   {chosen}")
        rows.append({"benchmark": "ms_reduce_scatter",
                     "case": f"reduce_scatter of {kib} KiB on {n} CPU ranks, ring vs all-reduce",
                     "hyperpar_ms": r_ms, "reference": "all-reduce + slice",
                     "reference_ms": a_ms, "ratio": r_ms / a_ms})
    if rank == 0:
        print(f"bench_ms_reduce_scatter: {n} ranks, median of {reps} reps; the platform uses "
              f"the ring from {threshold} x n^2 bytes")
        print(f"{'input':>13} {'all-reduce ms':>12} {'ring ms':>9} {'ring/all-red':>12}   "
              f"platform uses")
        print("\n".join(lines))
    return rows


if __name__ == "__main__":
    main()
