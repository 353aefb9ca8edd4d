"""hyperpar's main demo: a decoder trained with pipeline x tensor parallelism, checked against
the same model trained in one process.

    python examples/demo.py                      # spawns 4 processes itself (pp2 x tp2)
    hyperpar run -n 4 examples/demo.py           # the same under torchrun
    python examples/demo.py --layout tp          # 2 processes, tensor parallel only
    python examples/demo.py --layout pp          # 2 processes, pipeline only

Layout ``pp2xtp2`` on ranks 0-3: ``init_device_mesh((2, 2), ("pp", "tp"))`` gives the grid
[[0, 1], [2, 3]]; pipeline stage 0 runs on the tensor-parallel pair {0, 1}, stage 1 on {2, 3};
activations flow 0 -> 2 and 1 -> 3. The model (examples/pipeline_tied.py) is plain PyTorch: an
embedding tied with the output head across the two stages, residual MLP blocks whose ``up``
and ``down`` projections are sharded column- and row-wise inside each stage, trained with the
1F1B schedule over 4 microbatches. The reference is the same model written independently in
plain PyTorch (``pipeline_tied.PlainModel``: the same layers built with the same seeds, the
head tied to the embedding by hand), trained in one process on the full batch; the losses per
step and the final parameters must agree.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pipeline_tied import PlainModel, batches, layers, lm_loss  # noqa: E402

from hyperpar.dtensor import init_device_mesh  # noqa: E402
from hyperpar.parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # noqa: E402
from hyperpar.pipeline import PipelineModule, Schedule1F1B  # noqa: E402
from hyperpar.platform import get_platform  # noqa: E402

LAYOUTS = {"pp2xtp2": ((2, 2), ("pp", "tp")), "tp": ((2,), ("tp",)), "pp": ((2,), ("pp",))}
TP_PLAN = {"*.up": ColwiseParallel(), "*.down": RowwiseParallel()}
STEPS, BATCH, MICROBATCHES, LR = 6, 16, 4, 0.3


def train_reference(steps: int = STEPS) -> dict:
    """The plain model trained in one process on the full batch (no hyperpar involved)."""
    model = PlainModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for x, y in batches(steps, BATCH):
        optimizer.zero_grad(set_to_none=True)
        loss = lm_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return {"losses": losses,
            "params": {n: p.detach().clone() for n, p in model.pipeline_names().items()}}


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def train(layout: str, steps: int = STEPS, verbose: bool = True) -> dict:
    """Train on this rank. Returns the losses (on ranks of the last stage) and every local
    parameter, unsharded."""
    platform = get_platform()
    shape, names = LAYOUTS[layout]
    mesh = init_device_mesh(shape, mesh_dim_names=names)
    kwargs = {"mesh": mesh, "mesh_dim": "pp"} if "pp" in names else {"num_stages": 1}
    model = PipelineModule(layers(), loss_fn=lm_loss, seed_layers=True,
                           partition_method="parameters", **kwargs)
    if "tp" in names:
        parallelize_module(model, mesh["tp"], TP_PLAN)
    schedule = Schedule1F1B(model, n_microbatches=MICROBATCHES)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    last_stage = model.total_stages - 1 in model.local_stages
    losses = []
    for step, (x, y) in enumerate(batches(steps, BATCH)):
        optimizer.zero_grad(set_to_none=True)
        loss = schedule.step(x.to(platform.device()), target=y.to(platform.device()))
        optimizer.step()
        if last_stage:
            losses.append(loss.item())
            if verbose and platform.rank() == platform.world_size() - 1:
                print(f"[{layout}] step {step}: loss {loss.item():.4f}", flush=True)
    params = {n: _full(p).detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses if last_stage else None, "params": params}


def compare(results: list[dict], reference: dict) -> float:
    """Largest absolute difference between the parallel run and the single-process run, over
    the losses and every parameter any rank holds."""
    held = set().union(*(r["params"] for r in results))
    if held != set(reference["params"]):  # a parameter nobody holds, or one the model lacks
        return float("inf")
    losses = next(r["losses"] for r in results if r["losses"] is not None)
    diff = max(abs(a - b) for a, b in zip(losses, reference["losses"], strict=True))
    for rank_result in results:
        for name, value in rank_result["params"].items():
            diff = max(diff, (value - reference["params"][name]).abs().max().item())
    return diff


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="pp2xtp2")
    parser.add_argument("--steps", type=int, default=STEPS)
    args = parser.parse_args(argv)
    world = 4 if args.layout == "pp2xtp2" else 2
    if "WORLD_SIZE" in os.environ:  # one worker of `hyperpar run` / torchrun
        platform = get_platform()
        platform.init_process_group()
        train(args.layout, args.steps)
        platform.barrier()
        platform.destroy_process_group()
        return 0
    from hyperpar.testing import run_distributed

    print(f"hyperpar demo: {args.layout} on {world} processes, backend "
          f"{get_platform().name}", flush=True)
    results = run_distributed(train, world, args.layout, args.steps, timeout_s=300)
    reference = train_reference(args.steps)
    parallel = next(r["losses"] for r in results if r["losses"] is not None)
    for step, (a, b) in enumerate(zip(parallel, reference["losses"], strict=True)):
        print(f"step {step}: loss {a:.6f} (parallel)  {b:.6f} (plain torch, one process)")
    diff = compare(results, reference)
    ok = diff < 1e-4
    print(f"parity with one process: max |diff| over losses and parameters = {diff:.2e} "
          f"(tolerance 1e-4) -> {'OK' if ok else 'MISMATCH'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
