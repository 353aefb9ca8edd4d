"""Train a Llama-style model with its sequence split over the ranks (context parallelism).

    hyperpar run -n 2 examples/context_parallel.py      # or torchrun; 2 or 4 ranks

Each rank holds 1/cp of every sequence (tokens, labels, RoPE tables, in torch's head-tail
order) and attention gathers K and V across the ranks, so the activations per rank shrink with
cp. Gradients are averaged over the cp ranks like data-parallel ones. The same model trained on
whole sequences in one process must give the same logits, losses and parameters.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from llama.model import ModelArgs, batch, build  # noqa: E402

from hyperpar import get_platform  # noqa: E402
from hyperpar.dtensor import init_device_mesh  # noqa: E402
from hyperpar.parallel import context_parallel, context_parallel_unshard, data_parallel  # noqa: E402

STEPS = 3
ARGS = ModelArgs.tiny()  # max_seq_len 16: the sequence length, divisible by 2 x cp for cp <= 8


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def main() -> int:
    platform = get_platform()
    platform.init_process_group()
    mesh = init_device_mesh((platform.world_size(),), mesh_dim_names=("cp",))
    model = data_parallel(build(ARGS), mesh, "cp")
    reference = build(ARGS)  # the same weights (same seed), whole sequences, one process
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    worst = 0.0
    for step in range(STEPS):
        tokens, labels = batch(ARGS, batch_size=2, seed=step)
        ref_logits = reference(tokens)
        ref_loss = _loss(ref_logits, labels)
        ref_loss.backward()
        with context_parallel(mesh, buffers=[tokens, labels, model.rope_cos, model.rope_sin],
                              buffer_seq_dims=[1, 1, 0, 0]):
            logits = model(tokens)  # [batch, seq / cp, vocab] on each rank
            _loss(logits, labels).backward()  # this rank's tokens; data_parallel averages
            (full_logits,) = context_parallel_unshard(mesh, [logits.detach()], [1])
        loss = _loss(full_logits, labels)  # labels are whole again after the context
        worst = max(worst, (full_logits - ref_logits).abs().max().item())
        for p, ref in zip(model.parameters(), reference.parameters(), strict=True):
            worst = max(worst, (p.grad - ref.grad).abs().max().item())
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        if platform.rank() == 0:
            print(f"[cp{mesh.size()}] step {step}: loss {loss.item():.6f} "
                  f"(one process {ref_loss.item():.6f})")
    ok = worst <= 1e-4
    if platform.rank() == 0:
        print(f"max |difference| of logits and gradients vs one process: {worst:.2e} "
              f"-> {'OK' if ok else 'MISMATCH'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
