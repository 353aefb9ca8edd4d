"""Checkpoint saves: how long the training loop is blocked by ``save`` vs ``async_save``, and
the step time with an ``async_save`` in flight vs without.

    python benchmarks/bench_checkpoint.py [--ranks 2] [--mb 64] [--dim 512] [--repeats 3]
                                          [--json PATH]

Spawns ``--ranks`` processes. The model is a stack of ``Linear(dim, dim)`` layers sharded
``Shard(0)`` over the ranks, about ``--mb`` MB of fp32 parameters in all; a step is a forward,
backward and SGD update of every layer's local shard on a batch of 32 rows (no collective).
Per repeat, each rank measures:

* ``save`` -- the call's wall time (it returns once every rank wrote and rank 0 committed);
* ``async_save (call)`` -- the call's wall time: collectives plus staging to host memory;
* ``async_save (until committed)`` -- the call plus ``future.result()``;
* ``step`` -- a training step with nothing in flight, and ``step, save in flight`` -- steps
  started right after ``async_save`` returned, until its future is done (the background write
  competes for the CPU and the disk: on a host with spare cores that costs little).

Times are the median over repeats of the slowest rank. Files go to a temporary folder.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _model(mb: int, dim: int) -> nn.Module:
    from hyperpar.dtensor import Shard, distribute_tensor, init_device_mesh
    from hyperpar.platform import get_platform

    mesh = init_device_mesh((get_platform().world_size(),), mesh_dim_names=("dp",))
    layers = max(1, mb * 2**20 // (4 * dim * dim))
    model = nn.Sequential(*[nn.Linear(dim, dim, bias=False) for _ in range(layers)])
    for layer in model:
        layer.weight = nn.Parameter(distribute_tensor(layer.weight.detach(), mesh, [Shard(0)]))
    return model


def _step(shards: list[torch.Tensor], x: torch.Tensor) -> float:
    """Forward, backward and SGD update of every layer's local shard (views of the model's
    parameters, so the saves see the updates). No collective: ranks may run different numbers
    of steps while their saves are in flight, and a collective would need them to agree."""
    start = time.perf_counter()
    loss = sum(torch.tanh(x @ w.T).sum() for w in shards)
    loss.backward()
    with torch.no_grad():
        for w in shards:
            w -= 1e-4 * w.grad
            w.grad = None
    return time.perf_counter() - start


def _measure(mb: int, dim: int, repeats: int, folder: str) -> dict[str, list[float]]:
    from hyperpar.checkpoint import async_save, save
    from hyperpar.platform import get_platform

    platform = get_platform()
    torch.manual_seed(0)
    model = _model(mb, dim)
    shards = [layer.weight.to_local().detach().requires_grad_() for layer in model]
    x = torch.randn(32, dim)
    times: dict[str, list[float]] = {k: [] for k in (
        "save", "async_save (call)", "async_save (until committed)", "step",
        "step, save in flight")}
    _step(shards, x)  # warm-up
    save(model, folder)
    for _ in range(repeats):
        platform.barrier()
        start = time.perf_counter()
        save(model, folder)
        times["save"].append(time.perf_counter() - start)
        platform.barrier()
        times["step"].append(statistics.median(_step(shards, x) for _ in range(3)))
        platform.barrier()
        start = time.perf_counter()
        future = async_save(model, folder)
        times["async_save (call)"].append(time.perf_counter() - start)
        in_flight = []
        while not future.done() or not in_flight:
            in_flight.append(_step(shards, x))
        future.result()
        times["async_save (until committed)"].append(time.perf_counter() - start)
        times["step, save in flight"].append(statistics.median(in_flight))
    return times


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--mb", type=int, default=64, help="MB of fp32 parameters in all")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    from hyperpar.testing import run_distributed

    with tempfile.TemporaryDirectory() as folder:
        per_rank = run_distributed(_measure, args.ranks, args.mb, args.dim, args.repeats,
                                   folder, timeout_s=1800)
    rows = {k: statistics.median(max(r[k][i] for r in per_rank) for i in range(args.repeats))
            for k in per_rank[0]}
    print(f"checkpoint of {args.mb} MB fp32 over {args.ranks} ranks "
          f"(median of {args.repeats}, slowest rank)")
    for name, seconds in rows.items():
        print(f"  {name:32s} {seconds * 1e3:9.1f} ms")
    print(f"  blocked by async_save / by save:  {rows['async_save (call)'] / rows['save']:.3f}")
    print(f"  step with a save in flight / without: "
          f"{rows['step, save in flight'] / rows['step']:.2f}")
    result = {"ranks": args.ranks, "mb": args.mb, "seconds": rows}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
