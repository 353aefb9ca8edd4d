"""MindSpore backend: hyperpar's ``fully_shard`` training step vs the same Cell model replicated
with a hand-written gradient all-reduce (one ``mindspore.mint.distributed.all_reduce`` per
gradient, then ``/ n``), and vs no averaging at all (each rank's compute alone): step time and
bytes of parameters + optimizer state held per rank.

    HYPERPAR_BACKEND=mindspore hyperpar run -n 2 benchmarks/bench_ms_fully_shard.py [--steps 20]
        [--batch 64]

Run in the MindSpore venv (scripts/test-mindspore.sh builds it). ``hyperpar bench`` (torch)
finds this file by its name: without MindSpore it writes no rows and says why. Every variant
trains the same MLP blocks (same initial weights, same per-rank batch) with Adam; the variants
are timed alternately, one step each per round, so load on a shared host hits all alike; medians
of the timed steps after warm-up (rank 0's clock, each step starts at a barrier). Goals
(issue 32): fully_shard within 1.1x of the replicated step, ~1/N of the state bytes.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time

DIM, HIDDEN, LAYERS = 256, 1024, 4  # ~2.1 M parameters, 8.4 MB of float32


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=64,
                   help="rows per rank (larger: compute weighs more against communication)")
    p.add_argument("--profile", action="store_true",
                   help="also time the collectives one fully_shard step runs, alone")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if importlib.util.find_spec("mindspore") is None:
        print("bench_ms_fully_shard: MindSpore is not installed here; run it in the MindSpore "
              "venv with HYPERPAR_BACKEND=mindspore hyperpar run -n 2 "
              "benchmarks/bench_ms_fully_shard.py")
        if args.json:
            with open(args.json, "w") as f:
                json.dump([], f)
        return
    rows = run(args.steps, args.warmup, args.batch, args.profile)
    if args.json and rows is not None:
        with open(args.json, "w") as f:
            json.dump(rows, f)


def _net():
    from mindspore import nn

    class Block(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.act, self.down = nn.Dense(DIM, HIDDEN), nn.GELU(), nn.Dense(HIDDEN, DIM)

        def construct(self, x):
            return x + self.down(self.act(self.up(x)))

    return nn.SequentialCell([Block() for _ in range(LAYERS)])


def _state_bytes(net, opt) -> int:
    """Bytes this rank holds of parameters and Adam's two moments (a fully-sharded
    parameter's bytes are its padded shard's)."""
    params = sum(p.nbytes for p in net.trainable_params())
    moments = sum(m.nbytes for m in (*opt.moment1, *opt.moment2))
    return params + moments


def _profile(net, platform, steps: int) -> tuple[float, float]:
    """Median time of the collectives a fully_shard step runs, each unit's alone: the
    all-gather of its flat shard (MindSpore's list all-gather, as the unit does) and the
    all-reduce of its whole flat gradient (CPU MindSpore has no reduce-scatter kernel; the
    unit all-reduces and keeps its slice)."""
    import mindspore as ms
    import numpy as np

    def timed(fn, *args) -> float:
        times = []
        for _ in range(steps):
            platform.barrier()
            t0 = time.perf_counter()
            fn(*args)
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3

    gather, reduce_ = 0.0, 0.0
    for _name, cell in net.cells_and_names():
        unit = cell.__dict__.get("_hp_fsdp_unit")
        if unit is None or not unit.shards:
            continue
        numel, group = unit.plan.flat_numel, unit.shard_group
        shard = ms.Tensor(np.zeros(numel, np.float32))
        whole = ms.Tensor(np.zeros(numel * unit.plan.shard_size, np.float32))
        gather += timed(platform.gather_list, shard, group, "bench")
        reduce_ += timed(platform.all_reduce, whole, "sum", group)
    return gather, reduce_


def run(steps: int, warmup: int, batch: int, profile: bool = False) -> list[dict] | None:
    import mindspore as ms
    import mindspore.mint.distributed as dist
    import numpy as np
    from mindspore import nn

    from hyperpar import fully_shard, init_device_mesh
    from hyperpar.platform import get_platform

    platform = get_platform()
    platform.init_process_group()
    n, rank = platform.world_size(), platform.rank()
    mesh = init_device_mesh((n,), mesh_dim_names=("dp",))

    def build(shard: bool):
        ms.set_seed(0)  # the same initial weights in every variant
        net = _net()
        if shard:
            for block in net:
                fully_shard(block, mesh=mesh)
            fully_shard(net, mesh=mesh)
        return net

    def by_hand(grads):
        out = []
        for g in grads:
            g = g.copy()
            dist.all_reduce(g)
            out.append(g / n)
        return tuple(out)

    names = ("hyperpar fully_shard", "hand all-reduce", "no averaging")
    nets = {names[0]: build(True), names[1]: build(False), names[2]: build(False)}
    reduce = {names[0]: lambda g: g, names[1]: by_hand, names[2]: lambda g: g}
    rng = np.random.default_rng(rank)  # different data per rank
    x = ms.Tensor(rng.standard_normal((batch, DIM)).astype(np.float32))
    y = ms.Tensor(rng.standard_normal((batch, DIM)).astype(np.float32))
    runs = {}
    for name, net in nets.items():
        opt = nn.Adam(net.trainable_params(), learning_rate=1e-4)
        grad = ms.value_and_grad(lambda a, b, m=net: ((m(a) - b) ** 2).mean(), None,
                                 opt.parameters)
        runs[name] = (grad, opt)
    times: dict[str, list[float]] = {name: [] for name in names}
    losses: dict[str, float] = {}
    for i in range(steps + warmup):
        for name, (grad, opt) in runs.items():
            platform.barrier()
            t0 = time.perf_counter()
            loss, grads = grad(x, y)
            opt(reduce[name](grads))
            losses[name] = float(loss.asnumpy())
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    comm = _profile(nets[names[0]], platform, steps) if profile else None
    state = {name: _state_bytes(nets[name], runs[name][1]) for name in names}
    med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    if rank != 0:
        return None
    fs, hand, none = (med[k] for k in names)
    n_params = sum(int(np.prod(p.shape)) for p in nets[names[1]].trainable_params())
    case = (f"MLP {LAYERS} blocks ({DIM}->{HIDDEN}->{DIM}, {n_params / 1e6:.2f}M params), "
            f"batch {batch}/rank, Adam, {n} ranks, CPU")
    print(f"MindSpore {ms.__version__}, {case}; median step over {steps} (rank 0)")
    for name in names:
        print(f"  {name:<22} {med[name]:>9.2f} ms   params+Adam state "
              f"{state[name] / 2**20:>7.2f} MiB/rank   loss after {steps + warmup} steps "
              f"{losses[name]:.6f}")
    print(f"  time ratio fully_shard / hand all-reduce: {fs / hand:.3f} (goal <= 1.1); "
          f"averaging costs fully_shard {fs - none:.2f} ms, by hand {hand - none:.2f} ms")
    print(f"  state ratio fully_shard / replicated: {state[names[0]] / state[names[1]]:.3f} "
          f"(1/N = {1 / n:.3f}, plus padding)")
    if comm is not None:
        gather, reduce_ = comm
        print(f"  collectives alone, per step (fully_shard's units): all-gathers {gather:.2f} ms,"
              f" all-reduces {reduce_:.2f} ms (the hand-written step runs only all-reduces of "
              f"the same total size)")
    sys.stdout.flush()
    return [{"benchmark": "ms_fully_shard", "case": case, "hyperpar_ms": fs,
             "reference": "replicated, mint.distributed.all_reduce per gradient",
             "reference_ms": hand, "ratio": fs / hand,
             "state_mib": state[names[0]] / 2**20,
             "reference_state_mib": state[names[1]] / 2**20}]


if __name__ == "__main__":
    main()
