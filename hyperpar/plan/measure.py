"""``hyperpar plan --measure``: run layouts for real on this machine's cpu and compare.

Each measured layout runs the example Llama (``examples/llama``) on real processes of the
selected backend (``HYPERPAR_BACKEND``; the cpu backend, gloo, on a machine without
accelerators) through :func:`hyperpar.testing.run_distributed`, laid out with the real
``parallelize_module`` (the tensor + sequence parallel plan) and ``fully_shard`` (every block,
then the root), trains with AdamW, and reports:

* ``states``: bytes of the local parameter shards, their gradients and the optimizer states
  (``exp_avg``, ``exp_avg_sq``) on rank 0 -- the figure the memory model gives exactly;
* ``step_ms``: the median of timed steps (forward, backward, optimizer) after warm-up.

Peak memory is not measured on cpu (no allocator statistics a process can trust there); the
``peak`` field stays ``None``. Only layouts with ``pp == 1`` and ``dp_replicate == 1``
(fully_shard x tp) are measured. This module imports torch; nothing else in the planner does.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from .devices import DeviceProfile, save_profile
from .layout import Layout, Run
from .model import EXAMPLES, ModelSpec
from .search import PlanResult, plan

MEASURABLE_WORLDS = (2, 4)


def _examples_path() -> None:
    root = Path(__file__).resolve().parents[2]
    if (root / "examples" / "llama").is_dir() and str(root) not in sys.path:
        sys.path.insert(0, str(root))


def measurable(layout: Layout) -> bool:
    return layout.pp == 1 and layout.dp_replicate == 1 and layout.world in MEASURABLE_WORLDS


def _worker(example: str | dict[str, int], layout: dict[str, Any], seq_len: int, global_batch: int,
            steps: int, warmup: int) -> dict[str, float]:
    import torch
    import torch.nn.functional as F

    _examples_path()
    from examples.llama import model as llama
    from examples.llama import plan as plans
    from hyperpar import fully_shard, init_device_mesh, parallelize_module
    from hyperpar.dtensor import DTensor
    from hyperpar.platform import get_platform

    pf = get_platform()
    lay = Layout(**layout)
    sizes = EXAMPLES[example] if isinstance(example, str) else example
    args = llama.ModelArgs(**{**sizes, "max_seq_len": seq_len})
    mesh = init_device_mesh((lay.dp_shard, lay.tp), mesh_dim_names=("dp_shard", "tp"))
    model = llama.build(args, seed=0)
    if lay.tp > 1:
        parallelize_module(model, mesh["tp"], plans.tp_sp_plan())
    if lay.dp_shard > 1:
        for layer in model.layers:
            fully_shard(layer, mesh=mesh["dp_shard"])
        fully_shard(model, mesh=mesh["dp_shard"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    per = global_batch // lay.dp_shard
    micro = per // lay.microbatches
    dp_rank = mesh.get_local_rank("dp_shard")
    times = []
    for step in range(warmup + steps):
        tokens, labels = llama.batch(args, batch_size=global_batch, seq_len=seq_len, seed=step)
        tokens = tokens[dp_rank * per:(dp_rank + 1) * per]
        labels = labels[dp_rank * per:(dp_rank + 1) * per]
        pf.barrier()
        start = time.perf_counter()
        for i in range(lay.microbatches):
            rows = slice(i * micro, (i + 1) * micro)
            logits = model(tokens[rows])
            loss = F.cross_entropy(logits.float().flatten(0, 1), labels[rows].flatten())
            (loss / lay.microbatches).backward()
        opt.step()
        pf.barrier()
        if step >= warmup:
            times.append(time.perf_counter() - start)
        if step < warmup + steps - 1:
            opt.zero_grad()

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    def nbytes(t: torch.Tensor) -> int:
        loc = local(t)
        return loc.numel() * loc.element_size()

    params = [p for p in model.parameters()]
    states = sum(nbytes(p) for p in params)
    states += sum(nbytes(p.grad) for p in params if p.grad is not None)
    states += sum(nbytes(v) for p in params for k, v in opt.state[p].items()
                  if k in ("exp_avg", "exp_avg_sq"))
    return {"states": float(states), "step_ms": statistics.median(times) * 1e3}


def measure_layout(example: str | dict[str, int], layout: Layout, run: Run, *,
                   steps: int = 5, warmup: int = 2) -> dict[str, float]:
    """Run ``layout`` for real on ``layout.world`` cpu processes; rank 0's figures.
    ``example``: ``tiny``/``llama``, or a dict of ``examples/llama`` ``ModelArgs`` sizes."""
    from hyperpar.testing import run_distributed

    fields = {k: getattr(layout, k) for k in ("dp_replicate", "dp_shard", "tp", "pp",
                                               "microbatches", "activation_checkpointing")}
    out = run_distributed(_worker, layout.world, example, fields, run.seq_len,
                          run.global_batch, steps, warmup, timeout_s=300)
    return out[0]


def calibrate_cpu(ranks: int, size: int = 256, repeats: int = 20) -> DeviceProfile:
    """A cpu profile from this machine: matmul FLOP/s of one process while ``ranks`` run at
    once (they share the cores), one tiny layer's forward + backward (the fixed cost per
    layer), and gloo all-reduce latency and bandwidth (alpha, beta)."""
    from hyperpar.testing import run_distributed

    res = run_distributed(_calibrate_worker, ranks, size, repeats,
                          timeout_s=300)[0]
    return DeviceProfile(
        name=f"this cpu, {ranks} processes (measured)", flops_bf16=res["flops"],
        flops_fp32=res["flops"], memory_bytes=16 * 2**30, hbm_bytes_per_s=res["mem_bw"],
        intra_bytes_per_s=res["bw"], inter_bytes_per_s=res["bw"], intra_alpha_s=res["alpha"],
        inter_alpha_s=res["alpha"], compute_efficiency=1.0, link_efficiency=1.0,
        layer_overhead_s=res["overhead"],
        source="measured by hyperpar plan --measure")


def _layer_overhead_s(repeats: int) -> float:
    """Forward + backward of one example decoder layer so small that its FLOPs are nothing:
    what a layer costs in op dispatch, autograd and Python on this machine."""
    import torch

    _examples_path()
    from examples.llama import model as llama

    args = llama.ModelArgs(vocab_size=8, dim=8, n_layers=1, n_heads=2, ffn_hidden=8,
                           max_seq_len=4)
    block = llama.TransformerBlock(args)
    cos, sin = llama.rope_tables(args.head_dim, args.max_seq_len, args.rope_theta)
    x = torch.randn(1, 4, 8, requires_grad=True)
    times = []
    for i in range(repeats + 3):
        start = time.perf_counter()
        block(x, cos, sin).sum().backward()
        if i >= 3:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _calibrate_worker(size: int, repeats: int) -> dict[str, float]:
    import torch

    from hyperpar.platform import get_platform

    pf = get_platform()
    overhead = _layer_overhead_s(repeats)
    a, b = torch.randn(size, size), torch.randn(size, size)
    for _ in range(3):
        a @ b
    pf.barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    flops = 2 * size**3 * repeats / (time.perf_counter() - start)
    big = torch.randn(2**22)
    start = time.perf_counter()
    for _ in range(5):
        big.mul_(1.0)
    mem_bw = 2 * big.numel() * 4 * 5 / (time.perf_counter() - start)

    def allreduce_s(t: torch.Tensor, n: int) -> float:
        pf.all_reduce(t)
        pf.barrier()
        start = time.perf_counter()
        for _ in range(n):
            pf.all_reduce(t)
        return (time.perf_counter() - start) / n

    world = pf.world_size()
    small = allreduce_s(torch.zeros(1), 20)
    large_t = torch.zeros(2**20)
    large = allreduce_s(large_t, 5)
    ring = 2 * (world - 1)
    alpha = small / ring
    bw = 2 * (world - 1) / world * large_t.numel() * 4 / max(large - small, 1e-9)
    return {"flops": flops, "mem_bw": mem_bw, "alpha": alpha, "bw": bw, "overhead": overhead}


def measure_top(result: PlanResult, spec: ModelSpec, args: argparse.Namespace,
                per_world: int = 2) -> list[dict[str, Any]]:
    """Measure up to ``per_world`` of the best measurable layouts at 2 and 4 ranks; fills
    ``candidate.measured`` in ``result`` for those of its world and prints a comparison."""
    if not getattr(args, "example", None):
        raise SystemExit("hyperpar plan --measure runs the examples' models: give --example "
                         "tiny or --example llama")
    rows = []
    for world in MEASURABLE_WORLDS:
        run = Run(world=world, seq_len=args.seq_len, global_batch=args.global_batch,
                  param_dtype="float32", optimizer="adamw", gpus_per_node=world,
                  device_memory=result.run.device_memory)
        profile = calibrate_cpu(world)
        if world == MEASURABLE_WORLDS[0] and getattr(args, "save_profile", None):
            save_profile(profile, args.save_profile)
            print(f"wrote {args.save_profile}")
        local = plan(spec, run, profile)
        picked = [c for c in local.ranked if measurable(c.layout)][:per_world]
        for c in picked:
            got = measure_layout(args.example, c.layout, run)
            c.measured = {"peak": None, "step_ms": got["step_ms"]}
            rows.append({"world": world, "layout": c.layout.name,
                         "states_predicted": c.memory.states, "states_measured": got["states"],
                         "step_ms_predicted": c.time.step_ms, "step_ms_measured": got["step_ms"]})
            if world == result.run.world:
                for mine in result.ranked:
                    if mine.layout == c.layout:
                        mine.measured = c.measured
    print("predicted vs measured on this cpu (fp32, AdamW; rank 0):")
    print(f"{'world':>5}  {'layout':<22} {'states pred':>12} {'states meas':>12} "
          f"{'step ms pred':>12} {'step ms meas':>12}")
    for r in rows:
        print(f"{r['world']:>5}  {r['layout']:<22} {r['states_predicted']:>12,} "
              f"{int(r['states_measured']):>12,} {r['step_ms_predicted']:>12.2f} "
              f"{r['step_ms_measured']:>12.2f}")
    print()
    return rows
