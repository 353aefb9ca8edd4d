"""MindSpore backend: hyperpar's TP step vs a hand-written Megatron-style MLP, and the platform's
collectives vs ``mindspore.mint.distributed`` called directly.

    HYPERPAR_BACKEND=mindspore hyperpar run -n 2 benchmarks/mindspore_tp.py [--steps 20]

Run in the MindSpore venv (scripts/test-mindspore.sh builds it). Not a ``bench_*.py`` file:
``hyperpar bench`` runs the torch benchmarks. Medians of timed repetitions after warm-up; ratios
compare like with like (same process count, same threads, same collectives).
"""

from __future__ import annotations

import argparse
import statistics
import time

import mindspore as ms
import mindspore.mint.distributed as dist
import numpy as np
from mindspore import Parameter, Tensor, mint, nn

from hyperpar import ColwiseParallel, RowwiseParallel, init_device_mesh, parallelize_module
from hyperpar.platform import get_platform

DIM, HIDDEN, BATCH = 256, 1024, (16, 64)


class MLP(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Dense(DIM, HIDDEN)
        self.act = nn.GELU()
        self.fc2 = nn.Dense(HIDDEN, DIM)

    def construct(self, x):
        return self.fc2(self.act(self.fc1(x)))


class _CopyToRegion(nn.Cell):  # Megatron's f: identity forward, all-reduce backward
    def construct(self, x):
        return x

    def bprop(self, x, out, dout):
        g = dout.copy()
        dist.all_reduce(g)
        return (g,)


class _ReduceFromRegion(nn.Cell):  # Megatron's g: all-reduce forward, identity backward
    def construct(self, x):
        y = x.copy()
        dist.all_reduce(y)
        return y

    def bprop(self, x, out, dout):
        return (dout,)


class MegatronMLP(nn.Cell):
    """The same MLP written by hand for n ranks: fc1 split by rows, fc2 by columns."""

    def __init__(self, full: MLP, n: int, rank: int) -> None:
        super().__init__()
        w1, b1 = full.fc1.weight.asnumpy(), full.fc1.bias.asnumpy()
        w2, b2 = full.fc2.weight.asnumpy(), full.fc2.bias.asnumpy()
        k = HIDDEN // n
        self.fc1 = nn.Dense(DIM, k)
        self.fc1.weight = Parameter(Tensor(w1[rank * k:(rank + 1) * k].copy()), name="w1")
        self.fc1.bias = Parameter(Tensor(b1[rank * k:(rank + 1) * k].copy()), name="b1")
        self.fc2 = nn.Dense(k, DIM, has_bias=False)
        self.fc2.weight = Parameter(Tensor(w2[:, rank * k:(rank + 1) * k].copy()), name="w2")
        self.b2 = Parameter(Tensor(b2), name="b2")
        self.act = nn.GELU()
        self.f, self.g = _CopyToRegion(), _ReduceFromRegion()

    def construct(self, x):
        return self.g(self.fc2(self.act(self.fc1(self.f(x))))) + self.b2


def _step_times(models: list[nn.Cell], x: Tensor, y: Tensor, steps: int) -> list[float]:
    """Median step time of each model, measured alternately (ABAB...) so that load changes on a
    shared host hit both alike."""
    runs = []
    for model in models:
        opt = nn.SGD(model.trainable_params(), learning_rate=0.01)
        grad = ms.value_and_grad(lambda a, b, m=model: ((m(a) - b) ** 2).mean(), None,
                                 opt.parameters)
        runs.append((grad, opt))
    times: list[list[float]] = [[] for _ in models]
    for i in range(steps + 3):
        for k, (grad, opt) in enumerate(runs):
            get_platform().barrier()
            t0 = time.perf_counter()
            loss, grads = grad(x, y)
            opt(grads)
            loss.asnumpy()
            if i >= 3:
                times[k].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def _collective_time(fn, reps: int) -> float:
    times = []
    for i in range(reps + 3):
        get_platform().barrier()
        t0 = time.perf_counter()
        fn()
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    p = get_platform()
    p.init_process_group()
    mesh = init_device_mesh((p.world_size(),), mesh_dim_names=("tp",))
    n, rank = p.world_size(), p.rank()
    rng = np.random.default_rng(0)
    x = Tensor(rng.standard_normal((*BATCH, DIM)).astype(np.float32))
    y = Tensor(rng.standard_normal((*BATCH, DIM)).astype(np.float32))
    base = MLP()
    hyper = MLP()
    for a, b in zip(base.get_parameters(), hyper.get_parameters(), strict=True):
        b.set_data(Tensor(a.asnumpy()))
    hand = MegatronMLP(base, n, rank)
    parallelize_module(hyper, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    t_hyper, t_hand = _step_times([hyper, hand], x, y, args.steps)

    buf = Tensor(np.ones(1 << 18, np.float32))  # 1 MiB
    out = mint.zeros((n * (1 << 18),), dtype=ms.float32)
    rows = [mint.zeros((1 << 18,), dtype=ms.float32) for _ in range(n)]
    pairs = {
        "all_reduce 1 MiB": (lambda: p.all_reduce(buf), lambda: dist.all_reduce(buf)),
        "all_gather 1 MiB (composed)": (
            lambda: p.all_gather_into_tensor(out, buf),
            lambda: out.copy_(mint.cat(_gather(rows, buf)))),
        "broadcast 1 MiB": (lambda: p.broadcast(buf, 0), lambda: dist.broadcast(buf, 0)),
    }
    results = {name: (_collective_time(a, 20), _collective_time(b, 20))
               for name, (a, b) in pairs.items()}
    if rank == 0:
        print(f"MindSpore {ms.__version__}, {n} ranks, CPU; medians")
        print(f"TP MLP step ({DIM}->{HIDDEN}->{DIM}, batch {BATCH}): hyperpar {t_hyper * 1e3:.2f}"
              f" ms, hand-written Megatron {t_hand * 1e3:.2f} ms, ratio {t_hyper / t_hand:.3f}")
        for name, (ours, theirs) in results.items():
            print(f"{name}: platform {ours * 1e3:.2f} ms, mint.distributed {theirs * 1e3:.2f} ms, "
                  f"ratio {ours / theirs:.3f}")


def _gather(rows, buf):
    dist.all_gather(rows, buf)
    return rows


if __name__ == "__main__":
    main()
