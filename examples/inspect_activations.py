"""Capture and edit activations of a tensor-parallel Llama-style model, seen whole.

    python examples/inspect_activations.py          # spawns 2 processes (tp2) itself
    hyperpar run -n 2 examples/inspect_activations.py   # or torchrun: one rank per process

On 2 ranks the model runs with the TP plan of examples/llama/plan.py, so each rank holds half of
every MLP's hidden activation. ``InspectedModel`` gathers the hooked activations back to their
full shape on rank 0, and an edit (zeroing the first block's MLP output, an ablation) is
re-sharded and applied on every rank. The same captures and the same ablation on the unsharded
model in one process must give the same tensors and the same logits.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from llama.model import ModelArgs, batch, build  # noqa: E402
from llama.plan import tp_plan  # noqa: E402

from hyperpar.dtensor import init_device_mesh  # noqa: E402
from hyperpar.inspect import InspectedModel  # noqa: E402
from hyperpar.parallel import parallelize_module  # noqa: E402

ARGS = ModelArgs()
BATCH, SEQ = 2, 16
HIDDEN = "layers.*.feed_forward.w1"      # column-parallel: each rank holds half the columns
ABLATE = "layers.0.feed_forward"


def run(parallel: bool) -> dict:
    """Logits without and with the ablation, plus the captured hidden activations."""
    model = build(ARGS, seed=0)
    if parallel:
        mesh = init_device_mesh((2,), mesh_dim_names=("tp",))
        parallelize_module(model, mesh, tp_plan())
        inspected = InspectedModel(model, mesh=mesh)
    else:
        inspected = InspectedModel(model)
    inspected.register_forward_hook(HIDDEN, expected_shape=(BATCH, SEQ, ARGS.ffn_hidden))
    inspected.register_forward_hook(ABLATE, editing_function=lambda t: torch.zeros_like(t),
                                    group="ablation")
    tokens, _ = batch(ARGS, BATCH, SEQ, seed=1)
    with torch.no_grad():
        clean = inspected(tokens, hook_groups=["default"])
        captured = dict(inspected.captured)
        ablated = inspected(tokens, hook_groups=["ablation"])
    def full(t: torch.Tensor) -> torch.Tensor:
        return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu()

    return {"clean": full(clean), "ablated": full(ablated),
            "captured": {name: full(t) for name, t in captured.items()}}


def main() -> int:
    if "WORLD_SIZE" in os.environ:  # one worker of `hyperpar run` / torchrun
        return _launched_rank()
    from hyperpar.testing import run_distributed

    sharded = run_distributed(run, 2, True, timeout_s=300)[0]     # rank 0 holds the captures
    return report(sharded, run(False))


def _launched_rank() -> int:
    """Under a launcher each process is one rank; rank 0 reports the comparison."""
    from hyperpar.platform import get_platform

    platform = get_platform()
    platform.init_process_group()
    if platform.world_size() != 2:
        raise SystemExit(f"inspect_activations.py runs on 2 ranks (the tp2 plan), got "
                         f"{platform.world_size()}: launch it with -n 2 / --nproc-per-node 2")
    sharded = run(True)
    single = run(False)  # on every rank: capture gathers are collectives once a world exists
    status = report(sharded, single) if platform.rank() == 0 else 0
    platform.destroy_process_group()
    return status


def report(sharded: dict, single: dict) -> int:
    """Print the captures and compare the sharded run with one process; 0 when they agree."""
    print(f"captured on rank 0: {sorted(sharded['captured'])}")
    diff = 0.0
    for name, value in single["captured"].items():
        print(f"  {name}: full shape {tuple(sharded['captured'][name].shape)} "
              f"(each rank computed {ARGS.ffn_hidden // 2} of {ARGS.ffn_hidden} columns)")
        diff = max(diff, (sharded["captured"][name] - value).abs().max().item())
    for key in ("clean", "ablated"):
        diff = max(diff, (sharded[key] - single[key]).abs().max().item())
    moved = (single["ablated"] - single["clean"]).abs().max().item()
    print(f"ablation of {ABLATE} moves the logits by up to {moved:.3f}")
    ok = diff < 1e-4 and moved > 1e-3
    print(f"sharded vs one process: max |diff| over captures and logits = {diff:.2e} -> "
          f"{'OK' if ok else 'MISMATCH'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
