"""hyperpar DTensor vs torch.distributed.tensor, in one run, on the same 2-rank mesh.

1. redistribute: time per call of every transition (S->R, P->R, P->S, R->S, S->S, R->P) for
   hyperpar and for torch's DTensor, same shapes; ratio hyperpar / torch (< 1: hyperpar faster).
2. per-op dispatch overhead: time per call of small ops (no communication) on plain tensors,
   hyperpar DTensors and torch DTensors; overhead = time - plain time; ratio of overheads.

    python benchmarks/bench_dtensor.py [--size 1024] [--repeats 7] [--json F]

With ``--json F`` it writes the rows of the ``hyperpar bench`` contract (see hyperpar/bench.py):
one per transition (time per call) and one per op (dispatch *overhead* per call, i.e. time minus
the plain-tensor time, in ms), reference ``torch.distributed.tensor``.

This file may import torch.distributed.tensor (it is outside the library). Both ranks share the
machine's cores; compare ratios, not absolute numbers, across machines.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch


def _interleaved(fns: list[Callable[[], object]], iters: int, repeats: int, barrier=None,
                 stat=statistics.median) -> list[float]:
    """Seconds per call of each function; the functions take turns in every round so that
    background load hits them alike. ``stat`` (median, or min for dispatch overhead) is taken
    over ``repeats`` rounds of ``iters`` calls."""
    for fn in fns:
        for _ in range(max(2, iters // 10)):
            fn()
    runs: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for k, fn in enumerate(fns):
            if barrier is not None:
                barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            runs[k].append((time.perf_counter() - t0) / iters)
    return [stat(r) for r in runs]


def _bench(size: int, repeats: int, op_iters: int) -> dict:
    import torch.distributed.tensor as tdt
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh

    import hyperpar.dtensor as hdt
    from hyperpar.platform import get_platform

    platform = get_platform()
    torch.set_num_threads(1)
    device_type = platform.device_type
    dev = platform.device()
    ranks = platform.world_size()
    hmesh = hdt.init_device_mesh((ranks,))
    tmesh = torch_mesh(device_type, (ranks,))
    barrier = platform.barrier
    torch.manual_seed(0)
    full = torch.randn(size, size).to(dev)

    def H(p):  # noqa: N802
        return {"S0": hdt.Shard(0), "S1": hdt.Shard(1), "R": hdt.Replicate(),
                "P": hdt.Partial()}[p]

    def T(p):  # noqa: N802
        return {"S0": tdt.Shard(0), "S1": tdt.Shard(1), "R": tdt.Replicate(),
                "P": tdt.Partial()}[p]

    def make_h(p):
        if p == "P":
            return hdt.DTensor.from_local(full.clone(), hmesh, [hdt.Partial()])
        return hdt.distribute_tensor(full, hmesh, [H(p)])

    def make_t(p):
        if p == "P":
            return tdt.DTensor.from_local(full.clone(), tmesh, [tdt.Partial()])
        return tdt.distribute_tensor(full, tmesh, [T(p)])

    transitions = [("S0", "R"), ("P", "R"), ("P", "S0"), ("R", "S0"), ("S0", "S1"),
                   ("R", "P")]
    iters = max(3, int(2e7 / (size * size)))
    redis = []
    for src, dst in transitions:
        hx, tx = make_h(src), make_t(src)
        h_pl, t_pl = [H(dst)], [T(dst)]
        hfn = lambda hx=hx, h_pl=h_pl: hx.redistribute(hmesh, h_pl)  # noqa: E731
        if dst == "P":  # torch: "redistributing to Partial is for internal use only"
            (th,) = _interleaved([hfn], iters, repeats, barrier)
            redis.append((f"{src}->{dst}", th, None))
            continue
        tfn = lambda tx=tx, t_pl=t_pl: tx.redistribute(tmesh, t_pl)  # noqa: E731
        th, tt = _interleaved([hfn, tfn], iters, repeats, barrier)
        # the same result from both
        assert torch.allclose(hx.redistribute(hmesh, h_pl).full_tensor(),
                              tx.redistribute(tmesh, t_pl).full_tensor(), atol=1e-4)
        redis.append((f"{src}->{dst}", th, tt))

    # ---- per-op overhead on small tensors (no communication in any of these)
    n = 16
    a, b = torch.randn(n, n).to(dev), torch.randn(n, n).to(dev)
    bias = torch.randn(n).to(dev)
    ha = hdt.distribute_tensor(a, hmesh, [hdt.Shard(0)])
    hr = hdt.distribute_tensor(a, hmesh, [hdt.Replicate()])
    hw = hdt.distribute_tensor(b, hmesh, [hdt.Shard(1)])
    hb = hdt.distribute_tensor(bias, hmesh, [hdt.Replicate()])
    ta = tdt.distribute_tensor(a, tmesh, [tdt.Shard(0)])
    tr = tdt.distribute_tensor(a, tmesh, [tdt.Replicate()])
    tw = tdt.distribute_tensor(b, tmesh, [tdt.Shard(1)])
    tb = tdt.distribute_tensor(bias, tmesh, [tdt.Replicate()])
    la, lw, lb = ha.to_local(), hw.to_local(), bias
    ops = [
        ("relu(S0)", lambda: torch.relu(la), lambda: torch.relu(ha), lambda: torch.relu(ta)),
        ("mul(S0, 2.0)", lambda: la * 2.0, lambda: ha * 2.0, lambda: ta * 2.0),
        ("add(S0, S0)", lambda: la + la, lambda: ha + ha, lambda: ta + ta),
        ("add(S0, R bias)", lambda: la + lb, lambda: ha + hb, lambda: ta + tb),
        ("mm(R, S1)", lambda: torch.mm(a, lw), lambda: torch.mm(hr, hw),
         lambda: torch.mm(tr, tw)),
        ("sum(S0, dim=1)", lambda: la.sum(1), lambda: ha.sum(1), lambda: ta.sum(1)),
        ("view+transpose(S0)", lambda: la.view(-1, 8).t(), lambda: ha.view(-1, 8).t(),
         lambda: ta.view(-1, 8).t()),
    ]
    # the same ops on leaves that require grad (forward only: records the autograd graph)
    ga, gw = a.clone().requires_grad_(), b.clone().requires_grad_()
    gla = ga.detach()[: n // 2].clone().requires_grad_()
    glw = gw.detach()[:, : n // 2].clone().requires_grad_()
    gha = hdt.distribute_tensor(ga, hmesh, [hdt.Shard(0)])
    ghr = hdt.distribute_tensor(ga, hmesh, [hdt.Replicate()])
    ghw = hdt.distribute_tensor(gw, hmesh, [hdt.Shard(1)])
    gta = tdt.distribute_tensor(ga, tmesh, [tdt.Shard(0)])
    gtr = tdt.distribute_tensor(ga, tmesh, [tdt.Replicate()])
    gtw = tdt.distribute_tensor(gw, tmesh, [tdt.Shard(1)])
    grad_ops = [
        ("relu(S0)", lambda: torch.relu(gla), lambda: torch.relu(gha),
         lambda: torch.relu(gta)),
        ("add(S0, S0)", lambda: gla + gla, lambda: gha + gha, lambda: gta + gta),
        ("mm(R, S1)", lambda: torch.mm(ga, glw), lambda: torch.mm(ghr, ghw),
         lambda: torch.mm(gtr, gtw)),
    ]
    per_op, per_op_grad = [], []
    barrier()
    if platform.rank() == 0:  # no op communicates: rank 1 waits so it does not steal a core
        with torch.no_grad():
            for name, plain, hyper, torchd in ops:
                per_op.append((name, *_interleaved([plain, hyper, torchd], op_iters,
                                                   3 * repeats, stat=min)))
        for name, plain, hyper, torchd in grad_ops:
            per_op_grad.append((name, *_interleaved([plain, hyper, torchd], op_iters,
                                                    3 * repeats, stat=min)))
    barrier()
    return {"redistribute": redis, "per_op": per_op, "per_op_grad": per_op_grad, "size": size,
            "ranks": ranks, "device": str(dev)}


def _print(res: dict) -> None:
    size = res["size"]
    print(f"\nredistribute, {size}x{size} float32 ({size * size * 4 / 2**20:.0f} MiB global), "
          f"{res['ranks']} rank(s) ({res['device']}), median per call")
    print(f"{'transition':<12}{'hyperpar ms':>14}{'torch ms':>12}{'ratio h/t':>12}")
    for name, th, tt in res["redistribute"]:
        if tt is None:
            print(f"{name:<12}{th * 1e3:>14.3f}{'n/a':>12}{'n/a':>12}  (torch refuses R->P)")
            continue
        print(f"{name:<12}{th * 1e3:>14.3f}{tt * 1e3:>12.3f}{th / tt:>12.2f}")
    print("\nper-op dispatch, 16x16 float32, no grad, rank 0 alone, best round per call (µs); "
          "overhead = time - plain")
    print(f"{'op':<20}{'plain':>8}{'hyperpar':>10}{'torch':>9}{'h ovh':>8}{'t ovh':>8}"
          f"{'ovh h/t':>9}")
    ratios = []
    for name, tp, th, tt in res["per_op"]:
        oh, ot = th - tp, tt - tp
        ratios.append(oh / ot)
        print(f"{name:<20}{tp * 1e6:>8.1f}{th * 1e6:>10.1f}{tt * 1e6:>9.1f}{oh * 1e6:>8.1f}"
              f"{ot * 1e6:>8.1f}{oh / ot:>9.2f}")
    print(f"median overhead ratio hyperpar/torch: {statistics.median(ratios):.2f} "
          "(goal: <= 0.5)")
    print("\nthe same with inputs that require grad (forward, graph recorded), µs")
    print(f"{'op':<20}{'plain':>8}{'hyperpar':>10}{'torch':>9}{'h ovh':>8}{'t ovh':>8}"
          f"{'ovh h/t':>9}")
    for name, tp, th, tt in res["per_op_grad"]:
        oh, ot = th - tp, tt - tp
        print(f"{name:<20}{tp * 1e6:>8.1f}{th * 1e6:>10.1f}{tt * 1e6:>9.1f}{oh * 1e6:>8.1f}"
              f"{ot * 1e6:>8.1f}{oh / ot:>9.2f}")


def _rows(res: dict) -> list[dict]:
    """The results as rows of the ``hyperpar bench`` JSON contract."""
    ref = "torch.distributed.tensor"
    size = res["size"]
    rows = []
    for name, th, tt in res["redistribute"]:
        rows.append({"benchmark": "dtensor", "case": (f"redistribute {name} {size}x{size}, "
                                                       f"{res['ranks']} ranks"),
                     "hyperpar_ms": th * 1e3, "reference": ref,
                     "reference_ms": None if tt is None else tt * 1e3,
                     "ratio": None if tt is None else th / tt})
    for key, what in (("per_op", "no grad"), ("per_op_grad", "grad")):
        for name, tp, th, tt in res[key]:
            oh, ot = th - tp, tt - tp
            rows.append({"benchmark": "dtensor", "case": f"dispatch overhead {name}, {what}",
                         "hyperpar_ms": oh * 1e3, "reference": ref, "reference_ms": ot * 1e3,
                         "ratio": oh / ot})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=1024, help="global matrix side")
    parser.add_argument("--ranks", type=int, default=2,
                        help="processes (hyperpar bench passes 1 on a one-GPU host)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--op-iters", type=int, default=2000)
    parser.add_argument("--json", dest="json_path", default=None,
                        help="also write the rows of the hyperpar bench contract here")
    args = parser.parse_args()
    import warnings

    warnings.filterwarnings("ignore")
    from hyperpar.testing import run_distributed

    results = run_distributed(_bench, args.ranks, args.size, args.repeats, args.op_iters,
                              timeout_s=900)
    _print(results[0])
    if args.json_path:
        with open(args.json_path, "w") as fh:
            json.dump(_rows(results[0]), fh, indent=2)


if __name__ == "__main__":
    main()
