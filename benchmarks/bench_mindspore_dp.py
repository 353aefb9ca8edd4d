"""MindSpore backend: hyperpar's ``data_parallel`` step (bucketed gradient average through
``model.reduce_gradients``) vs the same replicated model averaged by hand (one
``mindspore.mint.distributed.all_reduce`` per gradient, then ``/ n``), and vs no averaging at all
(the compute alone).

    HYPERPAR_BACKEND=mindspore hyperpar run -n 2 benchmarks/bench_mindspore_dp.py [--steps 20]

Run in the MindSpore venv (scripts/test-mindspore.sh builds it). ``hyperpar bench`` (torch)
finds this file by its name: without MindSpore it writes no rows and says why. Medians of timed
steps after warm-up, the variants measured alternately so that load on a shared host hits all
alike.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time

DIM, HIDDEN, LAYERS, BATCH = 256, 1024, 3, 32  # ~2.4 M parameters, 9.5 MB of float32 gradients


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if importlib.util.find_spec("mindspore") is None:
        print("bench_mindspore_dp: MindSpore is not installed here; run it in the MindSpore venv "
              "with HYPERPAR_BACKEND=mindspore hyperpar run -n 2 benchmarks/bench_mindspore_dp.py")
        if args.json:
            with open(args.json, "w") as f:
                json.dump([], f)
        return
    rows = run(args.steps)
    if args.json and rows is not None:
        with open(args.json, "w") as f:
            json.dump(rows, f)


def _mlp():
    from mindspore import nn

    layers = []
    for _ in range(LAYERS):
        layers += [nn.Dense(DIM, HIDDEN), nn.GELU(), nn.Dense(HIDDEN, DIM)]
    return nn.SequentialCell(layers)


def run(steps: int) -> list[dict] | None:
    import mindspore as ms
    import mindspore.mint.distributed as dist
    import numpy as np
    from mindspore import nn

    from hyperpar import data_parallel
    from hyperpar.platform import get_platform

    platform = get_platform()
    platform.init_process_group()
    n, rank = platform.world_size(), platform.rank()
    ms.set_seed(0)
    models = {"hyperpar data_parallel": data_parallel(_mlp()), "hand all-reduce": _mlp(),
              "no averaging": _mlp()}

    def by_hand(grads):
        out = []
        for g in grads:
            g = g.copy()
            dist.all_reduce(g)
            out.append(g / n)
        return tuple(out)

    reduce = {"hyperpar data_parallel": models["hyperpar data_parallel"].reduce_gradients,
              "hand all-reduce": by_hand, "no averaging": lambda g: g}
    rng = np.random.default_rng(rank)
    x = ms.Tensor(rng.standard_normal((BATCH, DIM)).astype(np.float32))
    y = ms.Tensor(rng.standard_normal((BATCH, DIM)).astype(np.float32))
    runs = {}
    for name, model in models.items():
        opt = nn.SGD(model.trainable_params(), learning_rate=0.01)
        grad = ms.value_and_grad(lambda a, b, m=model: ((m(a) - b) ** 2).mean(), None,
                                 opt.parameters)
        runs[name] = (grad, opt)
    times: dict[str, list[float]] = {name: [] for name in models}
    for i in range(steps + 3):
        for name, (grad, opt) in runs.items():
            platform.barrier()
            t0 = time.perf_counter()
            loss, grads = grad(x, y)
            opt(reduce[name](grads))
            loss.asnumpy()
            if i >= 3:
                times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    if rank != 0:
        return None
    hp, hand, none = (med["hyperpar data_parallel"], med["hand all-reduce"],
                      med["no averaging"])
    case = f"MLP {LAYERS}x({DIM}->{HIDDEN}->{DIM}), batch {BATCH}/rank, {n} ranks, CPU"
    print(f"MindSpore {ms.__version__}, {case}; median step over {steps}")
    print(f"  hyperpar data_parallel: {hp:.2f} ms   hand all-reduce per gradient: {hand:.2f} ms"
          f"   no averaging: {none:.2f} ms")
    print(f"  ratio hyperpar / hand-written: {hp / hand:.3f}; averaging costs hyperpar "
          f"{hp - none:.2f} ms, by hand {hand - none:.2f} ms")
    sys.stdout.flush()
    return [{"benchmark": "mindspore_dp", "case": case, "hyperpar_ms": hp,
             "reference": "mint.distributed.all_reduce per gradient", "reference_ms": hand,
             "ratio": hp / hand}]


if __name__ == "__main__":
    main()
