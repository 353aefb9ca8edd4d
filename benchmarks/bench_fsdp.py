"""Sharded data parallelism: memory and step time of hyperpar's fully_shard vs torch FSDP2
(``torch.distributed.fsdp.fully_shard``, which runs on gloo) vs the replicated data_parallel.

    python benchmarks/bench_fsdp.py [--ranks 2] [--dim 128] [--layers 4] [--batch 8]
                                    [--steps 6] [--json PATH] [--compile-backend inductor]
                                    [--no-compile]

Spawns ``--ranks`` processes. Every variant trains the same Llama-style model (examples/llama)
on the same per-rank batch with AdamW:

* ``hyperpar fsdp`` -- :func:`hyperpar.fully_shard` per block and on the root (prefetch on);
* ``hyperpar fsdp, no prefetch`` -- the same with ``set_implicit_prefetch(False)``: every
  all-gather waits in the critical path (the difference is the overlap);
* ``torch FSDP2`` -- ``torch.distributed.fsdp.fully_shard`` on the same model (outside the
  library, so this benchmark may use torch.distributed);
* ``hyperpar dp`` -- the replicated :func:`hyperpar.parallel.data_parallel`.

Compiled rows (unless ``--no-compile``), torchtitan's recipe -- ``block.compile()`` on every
transformer block, then fully_shard each block and the root:

* ``compiled hyperpar fsdp`` / ``compiled torch FSDP2`` -- the two fully_shards;
* ``compiled plain`` -- the same compiled blocks without any sharding or gradient reduction
  (each rank alone: the floor that sharding's communication adds to).

Each compiled variant starts from ``torch._dynamo.reset()`` and counts dynamo's graph breaks
(``graph_break`` counters plus frames it gave up on and ran eagerly), the graphs compiled by the
end of the first step, and the recompiles after it (graphs compiled in later steps).

Memory per rank: bytes of parameters + gradients + optimizer states after a step (local shards
only), and the peak of live tensor bytes during a step, tracked by a ``TorchDispatchMode`` that
counts every tensor storage created and released (host memory has no allocator counters).
Times are the median over steps of the slowest rank's step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import weakref
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from examples.llama import model as llama  # noqa: E402


class LiveBytes(TorchDispatchMode):
    """Peak bytes of tensor storages alive at once, counting those created inside the mode
    on top of ``base`` (what existed before: the model and optimizer states)."""

    def __init__(self, base: int) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.base = self.peak = base

    def _release(self, key: int) -> None:
        self.live.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not t.is_meta:
                try:  # wrapper subclasses have no storage of their own (inner ones count)
                    storage = t.untyped_storage()
                    key = storage.data_ptr()
                except RuntimeError:
                    continue
                if key and key not in self.live:
                    self.live[key] = storage.nbytes()
                    weakref.finalize(t, self._release, key)
        self.peak = max(self.peak, self.base + sum(self.live.values()))
        return out


def _local_bytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def _state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    params = sum(_local_bytes(p) + _local_bytes(p.grad) for p in model.parameters())
    states = sum(_local_bytes(v) for s in opt.state.values() for v in s.values()
                 if torch.is_tensor(v) and v.ndim > 0)
    return params + states


def _dynamo_counts() -> tuple[int, int]:
    """(graph breaks + frames run eagerly, unique graphs) since the last counters reset."""
    from torch._dynamo.utils import counters

    frames = counters["frames"]
    skipped = frames["total"] - frames["ok"]
    return sum(counters["graph_break"].values()) + skipped, counters["stats"]["unique_graphs"]


def worker(args: llama.ModelArgs, batch: int, steps: int, warmup: int,
           compile_backend: str | None = None) -> dict[str, dict]:
    from hyperpar import fully_shard
    from hyperpar.parallel.data_parallel import data_parallel
    from hyperpar.platform import get_platform

    platform = get_platform()
    tokens, labels = llama.batch(args, batch_size=batch, seed=platform.rank())

    def run(model: torch.nn.Module) -> dict:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        times, peak, graphs_first = [], 0, 0
        for i in range(warmup + steps):
            if i == 1:
                graphs_first = _dynamo_counts()[1]
            platform.barrier()
            t0 = time.perf_counter()
            tracker = LiveBytes(_state_bytes(model, opt)) if i == warmup else None
            if tracker is not None:
                tracker.__enter__()
            try:
                logits = model(tokens)
                F.cross_entropy(logits.float().flatten(0, 1), labels.flatten()).backward()
                opt.step()
                opt.zero_grad(set_to_none=False)
            finally:
                if tracker is not None:
                    tracker.__exit__(None, None, None)
                    peak = tracker.peak
            platform.synchronize()
            if i >= warmup and tracker is None:
                times.append(time.perf_counter() - t0)
        breaks, graphs = _dynamo_counts()
        return {"times": times, "state_bytes": _state_bytes(model, opt), "peak_bytes": peak,
                "breaks": breaks, "graphs": graphs_first, "recompiles": graphs - graphs_first}

    def ours(prefetch: bool) -> torch.nn.Module:
        model = llama.build(args, seed=0)
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        if not prefetch:
            model.set_implicit_prefetch(False)
        return model

    def torch_fsdp2() -> torch.nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        mesh = init_device_mesh(platform.device().type, (platform.world_size(),))
        model = llama.build(args, seed=0)
        for layer in model.layers:
            torch_fully_shard(layer, mesh=mesh)
        torch_fully_shard(model, mesh=mesh)
        return model

    def compiled(shard: Any) -> Any:
        def make() -> torch.nn.Module:
            from torch._dynamo.utils import counters

            torch._dynamo.reset()
            counters.clear()
            model = llama.build(args, seed=0)
            for layer in model.layers:
                layer.compile(backend=compile_backend)
                if shard is not None:
                    shard(layer)
            if shard is not None:
                shard(model)
            return model
        return make

    def torch_shard() -> Any:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        mesh = init_device_mesh(platform.device().type, (platform.world_size(),))
        return lambda module: torch_fully_shard(module, mesh=mesh)

    variants = [("hyperpar fsdp", lambda: ours(True)),
                ("hyperpar fsdp, no prefetch", lambda: ours(False)),
                ("torch FSDP2", torch_fsdp2),
                ("hyperpar dp", lambda: data_parallel(llama.build(args, seed=0)))]
    if compile_backend:
        variants += [("compiled hyperpar fsdp", compiled(fully_shard)),
                     ("compiled torch FSDP2", compiled(torch_shard())),
                     ("compiled plain", compiled(None))]
    out = {}
    # interleave the variants over two rounds so drift on a busy machine hits all of them
    for _ in range(2):
        for name, make in variants:
            res = run(make())
            if name in out:
                out[name]["times"] += res["times"]
                for key in ("breaks", "recompiles"):  # the worse of the two rounds
                    out[name][key] = max(out[name][key], res[key])
            else:
                out[name] = res
    torch._dynamo.reset()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", default=None)
    parser.add_argument("--compile-backend", default="inductor",
                        help="torch.compile backend of the compiled rows (inductor, aot_eager)")
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled rows")
    args = parser.parse_args()
    if args.steps < 2 or args.warmup < 0:
        # the step after warm-up runs under the peak-memory tracker and is not timed
        parser.error(f"--steps must be >= 2 (the first step after warm-up measures peak "
                     f"memory and is not timed, so at least one more is needed to time), and "
                     f"--warmup >= 0; got --steps {args.steps} --warmup {args.warmup}")
    from hyperpar.testing import run_distributed

    margs = llama.ModelArgs(vocab_size=512, dim=args.dim, n_layers=args.layers,
                            n_heads=max(1, args.dim // 32), ffn_hidden=4 * args.dim,
                            max_seq_len=64)
    backend = None if args.no_compile else args.compile_backend
    results = run_distributed(worker, args.ranks, margs, args.batch, args.steps, args.warmup,
                              backend, timeout_s=1800)
    n_params = sum(p.numel() for p in llama.build(margs).parameters())
    case = (f"Llama {args.layers} layers dim {args.dim} ({n_params / 1e6:.2f}M params), "
            f"batch {args.batch}x64/rank, {args.ranks} ranks, AdamW")
    print(f"fsdp benchmark: {case}; median of {2 * (args.steps - 1)} timed steps (slowest rank)")
    med, state, peak = {}, {}, {}
    for name in results[0]:
        per_step = [max(ts) for ts in zip(*[r[name]["times"] for r in results], strict=True)]
        med[name] = statistics.median(per_step) * 1e3
        state[name] = max(r[name]["state_bytes"] for r in results) / 2**20
        peak[name] = max(r[name]["peak_bytes"] for r in results) / 2**20
        compiled = ""
        if name.startswith("compiled"):
            r0 = results[0][name]
            breaks = max(r[name]["breaks"] for r in results)
            recompiles = max(r[name]["recompiles"] for r in results)
            compiled = (f"   {breaks} breaks, {r0['graphs']} graphs, {recompiles} recompiles "
                        f"({backend})")
        print(f"  {name:<28} {med[name]:>9.1f} ms   params+grads+optim {state[name]:>7.2f} MiB"
              f"   peak {peak[name]:>7.2f} MiB{compiled}")
    ours, theirs = "hyperpar fsdp", "torch FSDP2"
    rows = [
        {"benchmark": "fsdp", "case": case, "hyperpar_ms": med[ours], "reference": theirs,
         "reference_ms": med[theirs], "ratio": med[ours] / med[theirs],
         "state_mib": state[ours], "reference_state_mib": state[theirs],
         "peak_mib": peak[ours], "reference_peak_mib": peak[theirs]},
        {"benchmark": "fsdp", "case": case + ", vs no prefetch", "hyperpar_ms": med[ours],
         "reference": "hyperpar fsdp, no prefetch",
         "reference_ms": med["hyperpar fsdp, no prefetch"],
         "ratio": med[ours] / med["hyperpar fsdp, no prefetch"]},
        {"benchmark": "fsdp", "case": case + ", memory vs replicated data_parallel",
         "hyperpar_ms": med[ours], "reference": "hyperpar dp", "reference_ms": med["hyperpar dp"],
         "ratio": med[ours] / med["hyperpar dp"], "state_mib": state[ours],
         "reference_state_mib": state["hyperpar dp"], "peak_mib": peak[ours],
         "reference_peak_mib": peak["hyperpar dp"]},
    ]
    if backend:
        ours_c = "compiled hyperpar fsdp"
        for ref in ("compiled plain", "compiled torch FSDP2"):
            ratio = med[ours_c] / med[ref]
            print(f"  {ours_c} / {ref}: {ratio:.2f}x")
            rows.append({"benchmark": "fsdp", "case": f"{case}, compiled ({backend})",
                         "hyperpar_ms": med[ours_c], "reference": ref, "reference_ms": med[ref],
                         "ratio": ratio,
                         "graph_breaks": max(r[ours_c]["breaks"] for r in results),
                         "recompiles": max(r[ours_c]["recompiles"] for r in results),
                         "reference_graph_breaks": max(r[ref]["breaks"] for r in results)})
        print(f"  hyperpar fsdp / torch FSDP2 (eager): {med[ours] / med[theirs]:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
