"""Smoke-test the collectives of the selected backend on a few processes.

    hyperpar run -n 2 examples/collectives_smoke.py            # launched by hyperpar/torchrun
    python examples/collectives_smoke.py [--nproc 2]           # spawns its own processes
    HYPERPAR_BACKEND=cpu python examples/collectives_smoke.py  # pick the backend

Each rank runs all_reduce, all_gather, reduce_scatter and broadcast through the platform
(never torch.distributed directly), checks the result against the expected values, and prints
what it got. Rank 0 prints "OK" when every rank passed.
"""

from __future__ import annotations

import argparse
import os

import torch

from hyperpar.platform import get_platform


def check_collectives() -> list[str]:
    """Run the four bulk collectives on this rank; return the lines to print. Raises
    ``AssertionError`` naming the collective whose result is wrong."""
    platform = get_platform()
    rank, world = platform.rank(), platform.world_size()
    device = platform.device()
    lines = []

    def report(name: str, got: torch.Tensor, expected: torch.Tensor) -> None:
        got = got.cpu()
        if not torch.equal(got, expected):
            raise AssertionError(f"rank {rank}: {name} gave {got.tolist()}, "
                                 f"expected {expected.tolist()}")
        lines.append(f"rank {rank}/{world} {name:<14} {got.tolist()}")

    # all_reduce: every rank contributes [rank+1, rank+1] -> sum of 1..world everywhere.
    t = torch.full((2,), float(rank + 1), device=device)
    platform.all_reduce(t, op="sum")
    total = float(world * (world + 1) // 2)
    report("all_reduce", t, torch.full((2,), total))

    # all_gather: each rank contributes one row [rank, rank] -> rows in rank order.
    out = torch.empty(world, 2, device=device)
    platform.all_gather_into_tensor(out, torch.full((1, 2), float(rank), device=device))
    report("all_gather", out, torch.arange(world, dtype=torch.float).repeat_interleave(2)
           .view(world, 2))

    # reduce_scatter: every rank holds [0, 1, ..., world-1]; rank i gets world * i.
    full = torch.arange(world, dtype=torch.float, device=device)
    mine = torch.empty(1, device=device)
    platform.reduce_scatter_tensor(mine, full, op="sum")
    report("reduce_scatter", mine, torch.tensor([float(world * rank)]))

    # broadcast: the last rank's value reaches everyone.
    src = world - 1
    b = torch.tensor([float(rank * 10 + 7)], device=device)
    platform.broadcast(b, src=src)
    report("broadcast", b, torch.tensor([float(src * 10 + 7)]))

    platform.barrier()
    return lines


def launched_main() -> None:
    """Under ``hyperpar run``/torchrun: join the group, check, print per rank, then OK."""
    from hyperpar.log import rank0_print

    platform = get_platform()
    platform.init_process_group()
    try:
        lines = check_collectives()
        print("\n".join(lines), flush=True)
        # Every rank passed (a failing rank raised above); agree before declaring success.
        ok = torch.ones(1, device=platform.device())
        platform.all_reduce(ok)
        rank0_print(f"OK: {platform.describe()} with {platform.world_size()} ranks", force=True)
    finally:
        platform.destroy_process_group()


def standalone_main(nproc: int) -> None:
    """Without a launcher: spawn ``nproc`` processes with the hyperpar test harness."""
    from hyperpar.testing import run_distributed

    per_rank = run_distributed(check_collectives, nproc)
    for lines in per_rank:
        print("\n".join(lines))
    print(f"OK: {get_platform().describe()} with {nproc} ranks")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2,
                        help="processes to spawn when not launched by hyperpar run/torchrun")
    args = parser.parse_args()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        launched_main()
    else:
        standalone_main(args.nproc)
