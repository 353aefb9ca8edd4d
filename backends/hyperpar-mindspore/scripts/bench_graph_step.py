"""Step time of a tensor-parallel MLP in PyNative mode vs compiled (``ms.jit``), 2 ranks.

    HYPERPAR_BACKEND=mindspore hyperpar run -n 2 \\
        backends/hyperpar-mindspore/scripts/bench_graph_step.py [--dim 256 --hidden 1024]

Four steps are timed in alternating rounds (forward, backward, SGD update): the TP MLP
(Colwise -> Rowwise) in PyNative mode and under ``ms.jit``, and the same MLP on one rank alone
(no communication) both ways. Prints the first step (the compile) and the median of the rest.
"""

from __future__ import annotations

import argparse
import statistics
import time

import mindspore as ms
import numpy as np
from hyperpar_mindspore import (
    ColwiseParallel,
    RowwiseParallel,
    init_device_mesh,
    parallelize_module,
)
from mindspore import nn

from hyperpar.platform import get_platform


class MLP(nn.Cell):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Dense(dim, hidden), nn.ReLU(), nn.Dense(hidden, dim)

    def construct(self, x):
        return self.fc2(self.act(self.fc1(x)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    mesh = init_device_mesh((2,), mesh_dim_names=("tp",))
    platform = get_platform()
    rng = np.random.default_rng(0)
    shape = (args.batch, args.seq, args.dim)
    x = ms.Tensor(rng.standard_normal(shape).astype(np.float32))
    y = ms.Tensor(rng.standard_normal(shape).astype(np.float32))

    def make(tp: bool, jit: bool):
        model = MLP(args.dim, args.hidden)
        if tp:
            parallelize_module(model, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        opt = nn.SGD(model.trainable_params(), learning_rate=0.01)

        def loss_fn(a, b):
            return ((model(a) - b) ** 2).mean()

        grad_fn = ms.value_and_grad(loss_fn, None, opt.parameters)

        def step(a, b):
            loss, grads = grad_fn(a, b)
            opt(grads)
            return loss

        return ms.jit(step) if jit else step

    steps = {(tp, jit): make(tp, jit) for tp in (True, False) for jit in (False, True)}
    first, times = {}, {key: [] for key in steps}
    for key, step in steps.items():
        start = time.perf_counter()
        step(x, y).asnumpy()
        first[key] = time.perf_counter() - start
        for _ in range(2):
            step(x, y).asnumpy()
    for _ in range(args.rounds):
        for key, step in steps.items():
            platform.barrier()
            start = time.perf_counter()
            step(x, y).asnumpy()
            times[key].append(time.perf_counter() - start)
    if platform.rank() == 0:
        print(f"MLP {args.dim} -> {args.hidden} -> {args.dim}, batch {shape[:2]}, 2 ranks, "
              f"median of {args.rounds} steps (rank 0)")
        for (tp, jit), ts in times.items():
            name = ("TP (2 ranks)" if tp else "one rank alone") + (
                ", ms.jit" if jit else ", PyNative")
            print(f"  {name:28s} {1000 * statistics.median(ts):8.2f} ms   first step "
                  f"{first[(tp, jit)]:.2f} s")


if __name__ == "__main__":
    main()
