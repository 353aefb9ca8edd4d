"""MindSpore backend: an expert-parallel step on Cells (``parallelize_module(experts, mesh,
ExpertParallel())``: count exchange, checks, dispatch, local experts, combine, backward) vs a
hand-written MindSpore all-to-all MoE of the same shape.

    HYPERPAR_BACKEND=mindspore hyperpar run -n 2 benchmarks/bench_moe_mindspore.py [--steps 20]

The hand-written version knows every rank's split table in advance (the routing is fixed), so
it skips the count exchange and the split-table gather, and runs the uneven all-to-all as
MindSpore 2.10 on CPU allows it (no AlltoAllV kernel): ``mint.distributed.all_gather`` of the
padded tokens, then this rank's rows, in a Cell whose ``bprop`` runs the reverse exchange.
Medians of timed steps after warm-up, the variants measured alternately.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time

E, D, H, T, K = 8, 64, 128, 256, 2  # experts, dim, hidden, tokens per rank, top-k


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if importlib.util.find_spec("mindspore") is None:
        print("bench_moe_mindspore: MindSpore is not installed here; run it in the MindSpore "
              "venv with HYPERPAR_BACKEND=mindspore hyperpar run -n 2 "
              "benchmarks/bench_moe_mindspore.py")
        rows: list[dict] | None = []
    else:
        rows = run(args.steps)
    if args.json and rows is not None:
        with open(args.json, "w") as f:
            json.dump(rows, f)


def _experts(w: dict, lo: int, hi: int):
    import mindspore as ms
    from mindspore import mint, nn

    class Experts(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            for name in ("w1", "w2", "w3"):
                setattr(self, name, ms.Parameter(ms.Tensor(w[name][lo:hi].copy()), name=name))

        def construct(self, x, counts):
            outs, start = [], 0
            for e, c in enumerate(counts.asnumpy().tolist()):
                if c or (e == 0 and not x.shape[0]):
                    xe = mint.narrow(x, 0, start, c)
                    h = mint.nn.functional.silu(mint.matmul(xe, self.w1[e].T)) * \
                        mint.matmul(xe, self.w3[e].T)
                    outs.append(mint.matmul(h, self.w2[e].T))
                start += c
            return mint.cat(outs) if len(outs) > 1 else outs[0]

    return Experts()


def _hand_exchange(tables, me, n, world_name):
    """A Cell: rows ``tables[me][d]`` to rank ``d``, by all-gather of padded inputs + select;
    ``bprop`` the reverse."""
    import mindspore.mint.distributed as dist
    from mindspore import mint, nn

    def exchange(x, send, recv):
        longest = max(sum(row) for row in send)
        if x.shape[0] < longest:
            x = mint.cat([x, mint.zeros((longest - x.shape[0], x.shape[1]), dtype=x.dtype)])
        got = [mint.zeros(tuple(x.shape), dtype=x.dtype) for _ in range(n)]
        dist.all_gather(got, x, group=world_name)
        pieces = [mint.narrow(got[s], 0, sum(send[s][:me]), send[s][me]) for s in range(n)
                  if send[s][me]]
        return mint.cat(pieces) if pieces else mint.zeros((0, x.shape[1]), dtype=x.dtype)

    back = [[tables[d][s] for d in range(n)] for s in range(n)]  # transposed: the reverse

    class Exchange(nn.Cell):
        def construct(self, x):
            return exchange(x, tables, None)

        def bprop(self, x, out, dout):
            return (exchange(dout, back, None),)

    return Exchange()


def run(steps: int) -> list[dict] | None:
    import mindspore as ms
    import numpy as np

    from hyperpar import ExpertParallel, init_device_mesh, parallelize_module
    from hyperpar.moe import ExpertPlacement, dispatch_plan
    from hyperpar.moe.routing import reference_count_exchange
    from hyperpar.platform import get_platform

    platform = get_platform()
    platform.init_process_group()
    n, me = platform.world_size(), platform.rank()
    rng = np.random.default_rng(0)
    w = {"w1": (rng.standard_normal((E, H, D)) * 0.1).astype(np.float32),
         "w2": (rng.standard_normal((E, D, H)) * 0.1).astype(np.float32),
         "w3": (rng.standard_normal((E, H, D)) * 0.1).astype(np.float32)}
    # each rank's routing: T * K assignments sorted by expert (fixed: every rank knows them all)
    counts = [np.bincount(np.random.default_rng(10 + r).integers(0, E, T * K), minlength=E)
              for r in range(n)]
    placement = ExpertPlacement(E, n)
    recv = reference_count_exchange([c.tolist() for c in counts], placement)
    plans = [dispatch_plan(counts[r].tolist(), recv[r], placement) for r in range(n)]
    x = ms.Tensor(np.random.default_rng(20 + me).standard_normal((T * K, D)).astype(np.float32))
    c = ms.Tensor(counts[me].astype(np.int64))
    g = ms.Tensor(np.ones((T * K, D), np.float32))

    mesh = init_device_mesh((n,), mesh_dim_names=("ep",))
    ep = parallelize_module(_experts(w, 0, E), mesh, ExpertParallel())
    lo, hi = placement.local_experts(me).start, placement.local_experts(me).stop
    local = _experts(w, lo, hi)
    world = platform._name(None, "bench")  # MindSpore's world group name
    table = [list(p.input_splits) for p in plans]
    forward = _hand_exchange(table, me, n, world)
    combine_tables = [[table[d][s] for d in range(n)] for s in range(n)]
    backward = _hand_exchange(combine_tables, me, n, world)
    perm = ms.Tensor(np.asarray(plans[me].permutation(), np.int32))
    inv = ms.Tensor(np.asarray(plans[me].inverse(), np.int32))
    local_counts = ms.Tensor(np.asarray(plans[me].tokens_per_local_expert, np.int64))

    def hand(inp):
        routed = ms.ops.gather(forward(inp), perm, 0)
        out = local(routed, local_counts)
        return (backward(ms.ops.gather(out, inv, 0)) * g).sum()

    def hyperpar_ep(inp):
        return (ep(inp, c) * g).sum()

    variants = {"hyperpar ExpertParallel": (hyperpar_ep, ep), "hand-written all-to-all":
                (hand, local)}
    grads = {name: ms.value_and_grad(fn, 0, model.trainable_params())
             for name, (fn, model) in variants.items()}
    # the two must agree before their times mean anything
    (l1, _), (l2, _) = grads["hyperpar ExpertParallel"](x), grads["hand-written all-to-all"](x)
    assert abs(float(l1.asnumpy()) - float(l2.asnumpy())) <= 1e-3 * max(
        1.0, abs(float(l2.asnumpy()))), (l1, l2)
    times: dict[str, list[float]] = {name: [] for name in grads}
    for i in range(steps + 3):
        for name, step in grads.items():
            platform.barrier()
            t0 = time.perf_counter()
            loss, _ = step(x)
            loss.asnumpy()
            if i >= 3:
                times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    if me != 0:
        return None
    hp, hw = med["hyperpar ExpertParallel"], med["hand-written all-to-all"]
    case = f"{E} experts ({D}->{H}->{D}, SwiGLU), {T} tokens x top-{K} per rank, {n} ranks, CPU"
    print(f"MindSpore {ms.__version__}, {case}; median forward+backward over {steps}")
    print(f"  hyperpar ExpertParallel: {hp:.2f} ms   hand-written all-to-all MoE: {hw:.2f} ms")
    print(f"  ratio hyperpar / hand-written: {hp / hw:.3f}")
    sys.stdout.flush()
    return [{"benchmark": "moe_mindspore", "case": case, "hyperpar_ms": hp,
             "reference": "hand-written all_gather+select all-to-all MoE", "reference_ms": hw,
             "ratio": hp / hw}]


if __name__ == "__main__":
    main()
