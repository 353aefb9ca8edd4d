"""Tensor(+sequence)-parallel training of the example Llama model, checked against one process.

    python examples/llama/train_tp.py                  # spawns 2 ranks on this machine
    python examples/llama/train_tp.py --no-sp --steps 8
    python examples/llama/train_tp.py --loss-parallel   # logits never gathered for the loss
    HYPERPAR_BACKEND=cpu torchrun --nproc-per-node 2 examples/llama/train_tp.py

Every rank builds the same model (same seed), shards it with the plan from ``plan.py`` and
trains it with SGD; alongside, it trains an unsharded copy in-process as the reference. Each
step prints the loss of both and, at the end, the largest difference of loss, logits and
gradients (parity tolerance: 1e-5, float32).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from examples.llama import model as llama  # noqa: E402
from examples.llama import plan as plans  # noqa: E402

TOLERANCE = 1e-5


def _full(t: torch.Tensor) -> torch.Tensor:
    from hyperpar.dtensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _local(t: torch.Tensor) -> torch.Tensor:
    from hyperpar.dtensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def train(steps: int = 5, sequence_parallel: bool = True, lr: float = 0.1,
          verbose: bool = True, use_loss_parallel: bool = False) -> dict:
    """Train on the already-initialised process group; return the parity figures."""
    from hyperpar.dtensor import init_device_mesh
    from hyperpar.parallel import loss_parallel, parallelize_module
    from hyperpar.platform import get_platform

    platform = get_platform()
    rank, world = platform.rank(), platform.world_size()
    args = llama.ModelArgs(vocab_size=128, dim=64, n_layers=2, n_heads=4, ffn_hidden=128,
                           max_seq_len=32)
    device = platform.device()  # the backend's device: cpu, cuda:i, npu:i
    reference = llama.build(args, seed=0).to(device)
    model = llama.build(args, seed=0).to(device)
    mesh = init_device_mesh((world,), mesh_dim_names=("tp",))
    if use_loss_parallel and not sequence_parallel:
        raise ValueError("--loss-parallel uses the TP+SP plan; drop --no-sp")
    plan = (plans.tp_sp_plan(loss_parallel=use_loss_parallel) if sequence_parallel
            else plans.tp_plan())
    parallelize_module(model, mesh, plan)
    say = print if (verbose and rank == 0) else (lambda *a, **k: None)
    say(f"[hyperpar] {world} ranks on backend {platform.name}; plan: "
        f"{'TP+SP' if sequence_parallel else 'TP'}"
        f"{' + loss_parallel' if use_loss_parallel else ''}; "
        f"w1 placements {model.layers[0].feed_forward.w1.weight.placements}")
    worst = {"loss": 0.0, "logits": 0.0, "grad": 0.0}
    start = time.perf_counter()
    for step in range(steps):
        tokens, labels = (t.to(device) for t in llama.batch(args, batch_size=4, seed=step))
        ref_logits = reference(tokens)
        ref_loss = F.cross_entropy(ref_logits.flatten(0, 1), labels.flatten())
        ref_loss.backward()
        logits = model(tokens)
        if use_loss_parallel:  # logits stay sharded on the vocabulary
            with loss_parallel():
                loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
            logits = logits.full_tensor().detach()  # only for the parity check
        else:
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        loss.backward()
        worst["loss"] = max(worst["loss"], abs(loss.item() - ref_loss.item()))
        worst["logits"] = max(worst["logits"], (logits - ref_logits).abs().max().item())
        ref_params = dict(reference.named_parameters())
        for name, p in model.named_parameters():
            diff = (_full(p.grad) - ref_params[name].grad).abs().max().item()
            worst["grad"] = max(worst["grad"], diff)
        with torch.no_grad():
            for p in list(model.parameters()) + list(reference.parameters()):
                _local(p).add_(_local(p.grad), alpha=-lr)
                p.grad = None
        say(f"step {step}: loss {loss.item():.6f}   (one process: {ref_loss.item():.6f})")
    worst["seconds"] = time.perf_counter() - start
    worst["ok"] = all(worst[k] <= TOLERANCE for k in ("loss", "logits", "grad"))
    return worst


def _report(result: dict) -> None:
    verdict = "PASS" if result["ok"] else "FAIL"
    print(f"parity vs one process (tolerance {TOLERANCE:g}): {verdict} -- max |diff| loss "
          f"{result['loss']:.2e}, logits {result['logits']:.2e}, grads {result['grad']:.2e} "
          f"({result['seconds']:.1f} s)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="2-process TP(+SP) training with parity check")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--no-sp", action="store_true", help="tensor parallelism only")
    parser.add_argument("--loss-parallel", action="store_true",
                        help="keep the logits vocabulary-sharded; loss under loss_parallel()")
    args = parser.parse_args(argv)
    sp = not args.no_sp
    if "RANK" in os.environ:  # under torchrun / hyperpar run
        from hyperpar.platform import get_platform

        get_platform().init_process_group()
        result = train(args.steps, sp, use_loss_parallel=args.loss_parallel)
        if get_platform().rank() == 0:
            _report(result)
        get_platform().barrier()
        get_platform().destroy_process_group()
        return 0 if result["ok"] else 1
    from hyperpar.testing import run_distributed

    result = run_distributed(train, args.world_size, args.steps, sp,
                             use_loss_parallel=args.loss_parallel)[0]
    _report(result)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
