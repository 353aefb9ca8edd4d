"""Expert parallelism, side by side in one run: (a) a forward+backward step of ``hyperpar.moe.MoE``
with ``ExpertParallel()`` vs the same model under torch's own DTensor and functional collectives
with a hand-written torchtitan-style EP style; (b) hyperpar's dispatch + combine vs two raw
``torch.distributed.all_to_all_single`` calls of the same split sizes.

Run: ``python benchmarks/bench_moe.py [--ranks 2|4] [--rounds 5] [--json F]``

Both sides of each row run in the same processes on the same weights and tokens (the two models'
outputs are checked to agree first), interleaved round by round; each figure is the median over
rounds of the per-step time. Ratios > 1 mean hyperpar is slower.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402  (reference side, outside the library)
from torch import nn  # noqa: E402

DIM, HID, EXPERTS, TOP_K, TOKENS = 128, 256, 8, 2, 256


# ------------------------------------------------------------------ torch-native EP (torchtitan's)
class TorchExpertParallel:
    """torchtitan's ``ExpertParallel`` written against torch: experts ``Shard(0)`` on the ep mesh
    (``distribute_module``), funcol all-to-alls for the counts and tokens, split/cat regrouping."""

    def apply(self, module: nn.Module, mesh) -> nn.Module:
        from torch.distributed.tensor import Shard, distribute_module, distribute_tensor

        def partition(name, mod, device_mesh):
            for pname, p in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(pname, nn.Parameter(
                    distribute_tensor(p, device_mesh, [Shard(0)])))

        return distribute_module(module, mesh, partition, self._dispatch, self._combine)

    def _dispatch(self, mod, inputs, mesh):
        from torch.distributed._functional_collectives import (
            all_to_all_single,
            all_to_all_single_autograd,
        )

        routed, counts = inputs
        ep = mesh.shape[0]
        group = mesh.get_group()
        with torch.no_grad():
            counts = counts.to(torch.int64)
            received = all_to_all_single(counts, None, None, group=group)
            received = torch.ops._c10d_functional.wait_tensor(received)
            self.input_splits = counts.view(ep, -1).sum(1).tolist()
            self.output_splits = received.view(ep, -1).sum(1).tolist()
            per = received.view(ep, -1)  # rank-major: [rank][local expert]
        out = all_to_all_single_autograd(routed, self.output_splits, self.input_splits, group)
        n_local = per.shape[1]
        sizes = per.reshape(-1).tolist()
        order = [r * n_local + e for e in range(n_local) for r in range(ep)]
        self.sizes, self.order = sizes, order
        pieces = torch.split(out, sizes)
        out = torch.cat([pieces[i] for i in order])
        return out, per.sum(0)

    def _combine(self, mod, out, mesh):
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        pieces = torch.split(out, [self.sizes[i] for i in self.order])
        back = [None] * len(self.order)
        for piece, i in zip(pieces, self.order, strict=True):
            back[i] = piece
        out = torch.cat(back)
        return all_to_all_single_autograd(out, self.input_splits, self.output_splits,
                                          mesh.get_group())


def _model():
    from hyperpar.moe import MoE

    torch.manual_seed(0)
    return MoE(DIM, HID, num_experts=EXPERTS, top_k=TOP_K, num_shared_experts=1)


def _step(model, x):
    y = model(x)
    y.square().mean().backward()
    return y


def _timed(fns: dict, rounds: int, iters: int) -> dict[str, float]:
    from hyperpar.platform import get_platform

    times: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                fns[name]()
            get_platform().synchronize()
            times[name].append((time.perf_counter() - start) / iters * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def _measure(rounds: int) -> list[dict]:
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh

    from hyperpar import ExpertParallel, init_device_mesh, parallelize_module
    from hyperpar.platform import get_platform
    from hyperpar.torch.moe.dispatch import combine, dispatch, plan_dispatch

    platform = get_platform()
    rank, world = platform.rank(), platform.world_size()
    device = platform.device() if hasattr(platform, "device") else torch.device("cpu")
    mesh = init_device_mesh((world,), mesh_dim_names=("ep",))
    tmesh = torch_mesh(device.type, (world,), mesh_dim_names=("ep",))
    ours = parallelize_module(_model().to(device), mesh, {"experts": ExpertParallel()})
    native = _model().to(device)
    native.experts = TorchExpertParallel().apply(native.experts, tmesh)
    x = torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(rank)).to(device)
    diff = (_step(ours, x) - _step(native, x)).abs().max().item()
    assert diff < 1e-5, f"hyperpar and torch-native EP disagree by {diff}"
    rows = []
    med = _timed({"hyperpar": lambda: _step(ours, x), "torch": lambda: _step(native, x)},
                 rounds, 5)
    rows.append({"case": f"MoE E{EXPERTS} k{TOP_K} fwd+bwd", "reference": "torch DTensor+funcol EP",
                 "hyperpar_ms": med["hyperpar"], "reference_ms": med["torch"],
                 "ratio": med["hyperpar"] / med["torch"]})

    # (b) the exchange alone: the same splits through dispatch + combine and through raw calls
    from hyperpar.moe.placement import ExpertPlacement

    _, ids, counts, _ = ours.router(x)
    order = torch.argsort(ids.reshape(-1), stable=True)
    routed = x[order // TOP_K]
    placement = ExpertPlacement(EXPERTS, world)
    group = mesh.get_group("ep")
    plan = plan_dispatch(routed, counts, placement, group)
    out_rows = sum(plan.output_splits)

    def ours_exchange():
        combine(dispatch(routed, plan, group), plan, group)

    recv = routed.new_empty(out_rows, DIM)
    back = torch.empty_like(routed)

    def raw_exchange():
        dist.all_to_all_single(recv, routed, plan.output_splits, plan.input_splits)
        dist.all_to_all_single(back, recv, plan.input_splits, plan.output_splits)

    med = _timed({"hyperpar": ours_exchange, "raw": raw_exchange}, rounds, 20)
    rows.append({"case": f"dispatch+combine {TOKENS * TOP_K}x{DIM}",
                 "reference": "2x raw all_to_all_single", "hyperpar_ms": med["hyperpar"],
                 "reference_ms": med["raw"], "ratio": med["hyperpar"] / med["raw"]})
    return rows


def main(argv: list[str] | None = None) -> int:
    from hyperpar.platform import get_platform
    from hyperpar.testing import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args(argv)
    rows = run_distributed(_measure, args.ranks, args.rounds, timeout_s=600)[0]
    print(f"expert parallelism, {args.ranks} ranks, backend {get_platform().name}, "
          f"torch {torch.__version__}; {TOKENS} tokens/rank, dim {DIM}, hidden {HID}, "
          f"{EXPERTS} experts, top-{TOP_K}, 1 shared expert")
    print(f"{'case':<28}{'reference':<28}{'hyperpar ms':>12}{'ref ms':>10}{'ratio':>8}")
    for row in rows:
        print(f"{row['case']:<28}{row['reference']:<28}{row['hyperpar_ms']:>12.2f}"
              f"{row['reference_ms']:>10.2f}{row['ratio']:>8.3f}")
    if args.json_path:
        with open(args.json_path, "w") as fh:
            json.dump(rows, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
