"""Data parallelism: step time of hyperpar's data_parallel vs torch DDP vs a naive loop.

    python benchmarks/bench_dp.py [--ranks 2] [--dim 256] [--blocks 8] [--batch 64]
                                  [--steps 8] [--rounds 3] [--json PATH]

Spawns ``--ranks`` processes (one thread each). Every variant trains the same stack of MLP
blocks on the same per-rank batch (forward, backward, gradient averaging, SGD step):

* ``hyperpar`` -- :func:`hyperpar.parallel.data_parallel.data_parallel` (25 MB buckets,
  all-reduces launched during backward), and with 1 MB buckets;
* ``naive`` -- one blocking all-reduce per parameter after backward (what bucketing and
  overlap are meant to beat);
* ``torch DDP`` -- ``torch.nn.parallel.DistributedDataParallel`` (outside the library, so this
  benchmark may use it), 25 MB buckets.

The variants run in interleaved rounds (each round: ``--steps`` steps of every variant), so a
slow spell of a shared machine hits them alike. Times are the median over all steps of the
slowest rank's step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from models import Block  # the script's folder is on sys.path
from torch import nn


def _model(dim: int, blocks: int, device: torch.device | None = None) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(dim) for _ in range(blocks)])
    return model if device is None else model.to(device)


def worker(dim: int, blocks: int, batch: int, steps: int, warmup: int,
           rounds: int) -> dict[str, list[float]]:
    from hyperpar.parallel.data_parallel import data_parallel
    from hyperpar.platform import get_platform

    platform = get_platform()
    device = platform.device()
    g = torch.Generator().manual_seed(platform.rank())
    x = torch.randn(batch, dim, generator=g).to(device)
    y = torch.randn(batch, dim, generator=g).to(device)

    def timed(model: nn.Module, opt: torch.optim.Optimizer, after_backward=None,
              warm: int = 0) -> list[float]:
        times = []
        for i in range(warm + steps):
            platform.barrier()
            t0 = time.perf_counter()
            nn.functional.mse_loss(model(x), y).backward()
            if after_backward is not None:
                after_backward(model)
            opt.step()
            opt.zero_grad(set_to_none=True)
            platform.synchronize()
            if i >= warm:
                times.append(time.perf_counter() - t0)
        return times

    def naive(model: nn.Module) -> None:
        for p in model.parameters():
            platform.all_reduce(p.grad, op="avg")

    from torch.nn.parallel import DistributedDataParallel

    models = {
        "hyperpar 25MB": (data_parallel(_model(dim, blocks, device)), None),
        "hyperpar 1MB": (data_parallel(_model(dim, blocks, device), bucket_cap_mb=1), None),
        "naive": (_model(dim, blocks, device), naive),
        "torch DDP": (DistributedDataParallel(_model(dim, blocks, device)), None),
    }
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, (m, _) in models.items()}
    out: dict[str, list[float]] = {k: [] for k in models}
    # interleaved rounds: a slow spell of a shared machine hits every variant alike
    for r in range(rounds):
        for k, (model, after) in models.items():
            out[k] += timed(model, opts[k], after, warm=warmup if r == 0 else 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3,
                        help="interleaved rounds of --steps steps per variant")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from hyperpar.testing import run_distributed

    results = run_distributed(worker, args.ranks, args.dim, args.blocks, args.batch, args.steps,
                              args.warmup, args.rounds, timeout_s=600)
    n_params = sum(p.numel() for p in _model(args.dim, args.blocks).parameters())
    case = (f"{args.blocks} MLP blocks dim {args.dim} ({n_params / 1e6:.1f}M params), batch "
            f"{args.batch}/rank, {args.ranks} ranks")
    print(f"data-parallel benchmark: {case}; median of {args.rounds} interleaved rounds x "
          f"{args.steps} steps (slowest rank)")
    med = {}
    for name in results[0]:
        per_step = [max(ts) for ts in zip(*[r[name] for r in results], strict=True)]
        med[name] = statistics.median(per_step) * 1e3
        print(f"  {name:<16} {med[name]:>9.1f} ms")
    rows = [
        {"benchmark": "dp", "case": case + ", 25MB buckets", "hyperpar_ms": med["hyperpar 25MB"],
         "reference": "torch DDP", "reference_ms": med["torch DDP"],
         "ratio": med["hyperpar 25MB"] / med["torch DDP"]},
        {"benchmark": "dp", "case": case + ", vs per-parameter all-reduce",
         "hyperpar_ms": med["hyperpar 25MB"], "reference": "naive loop",
         "reference_ms": med["naive"], "ratio": med["hyperpar 25MB"] / med["naive"]},
    ]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
