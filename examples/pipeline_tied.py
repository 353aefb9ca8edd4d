"""Pipeline parallelism with a tied embedding / output head.

    python examples/pipeline_tied.py                  # spawns 2 ranks itself
    python examples/pipeline_tied.py --schedule zerobubble --microbatches 6
    hyperpar run -n 2 examples/pipeline_tied.py        # or torchrun --nproc-per-node 2

A small decoder-style model is written as a list of layers: a token embedding, residual MLP
blocks, a norm, and an output head that *reuses the embedding matrix* (``TiedLayerSpec`` with
the same key). The embedding lands on the first stage and the head on the last; hyperpar
broadcasts the shared matrix at build time and sums its two gradient halves after each backward,
so both copies stay identical. The last stage prints the loss per step; at the end the losses
are compared with the same model written in plain PyTorch (``PlainModel``, head tied by hand)
and trained in one process.

From Python (e.g. the README demo): ``from examples.pipeline_tied import demo; demo()``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch import nn

from hyperpar.pipeline import LayerSpec, PipelineModule, TiedLayerSpec, get_schedule_class

VOCAB, DIM, SEQ = 64, 32, 8


class Block(nn.Module):
    """Pre-norm residual MLP block (plain PyTorch: no parallel code in the model)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def lm_head(embedding: nn.Embedding, h: torch.Tensor) -> torch.Tensor:
    """Output projection reusing the embedding matrix: logits = h @ E^T / sqrt(d)."""
    return h @ embedding.weight.t() * DIM ** -0.5


def layers(n_blocks: int = 4) -> list:
    return [
        TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM),
        *[LayerSpec(Block, DIM) for _ in range(n_blocks)],
        LayerSpec(nn.LayerNorm, DIM),
        TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM, forward_fn=lm_head),
    ]


#: PipelineModule's default ``base_seed``: with ``seed_layers=True`` layer ``i`` is built right
#: after ``manual_seed(BASE_SEED + i)`` (a tied layer at its first position's index).
BASE_SEED = 1234


class PlainModel(nn.Module):
    """``layers()`` as one plain PyTorch model, with no hyperpar code: the
    reference the parallel run is checked against."""

    def __init__(self, n_blocks: int = 4) -> None:
        super().__init__()
        torch.manual_seed(BASE_SEED)
        self.embed = nn.Embedding(VOCAB, DIM)
        blocks = []
        for i in range(1, n_blocks + 1):
            torch.manual_seed(BASE_SEED + i)
            blocks.append(Block(DIM))
        self.blocks = nn.Sequential(*blocks)
        torch.manual_seed(BASE_SEED + n_blocks + 1)
        self.norm = nn.LayerNorm(DIM)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return lm_head(self.embed, self.norm(self.blocks(self.embed(tokens))))  # tied head

    def pipeline_names(self) -> dict[str, torch.Tensor]:
        """Parameters keyed as PipelineModule names them (layer index, or the tied key)."""
        out = {}
        for name, p in self.named_parameters():
            head, rest = name.split(".", 1)
            if head == "embed":
                out[f"tied_modules.embed.{rest}"] = p
            elif head == "blocks":
                index, rest = rest.split(".", 1)
                out[f"{int(index) + 1}.{rest}"] = p
            else:  # the norm after the blocks
                out[f"{len(self.blocks) + 1}.{rest}"] = p
        return out


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def batches(steps: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Next-token prediction on a fixed random permutation (learnable)."""
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(VOCAB, generator=g)
    out = []
    for _ in range(steps):
        x = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
        out.append((x, perm[x]))
    return out


def train(steps: int = 8, batch: int = 16, n_microbatches: int = 4, schedule: str = "1f1b",
          virtual_stages: int = 1, lr: float = 0.3, verbose: bool = True) -> list[float] | None:
    """Train on this rank's stage; returns the losses on the last stage, ``None`` elsewhere.
    Works in one process too (a one-stage pipeline = the whole model)."""
    from hyperpar.platform import get_platform

    platform = get_platform()
    device = platform.device()
    module = PipelineModule(layers(), loss_fn=lm_loss, seed_layers=True,
                            partition_method="parameters", virtual_stages=virtual_stages)
    sched = get_schedule_class(schedule)(module, n_microbatches)
    opt = torch.optim.SGD(module.parameters(), lr=lr)
    is_last = module.total_stages - 1 in module.local_stages
    losses = []
    for step, (x, y) in enumerate(batches(steps, batch)):
        opt.zero_grad(set_to_none=True)
        loss = sched.step(x.to(device), target=y.to(device))
        opt.step()
        if is_last:
            losses.append(loss.item())
            if verbose and module.num_stages > 1:
                print(f"[pipeline {schedule}, {module.num_stages} stages, "
                      f"{n_microbatches} microbatches] step {step}: loss {loss.item():.4f}",
                      flush=True)
    return losses if is_last else None


def train_plain(steps: int = 8, batch: int = 16, lr: float = 0.3) -> list[float]:
    """The reference: :class:`PlainModel` (no hyperpar code) trained in one process on the full
    batch; the loss per step."""
    model = PlainModel()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for x, y in batches(steps, batch):
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def demo(world_size: int = 2, steps: int = 8, n_microbatches: int = 4,
         schedule: str = "1f1b", verbose: bool = True) -> dict:
    """Spawn ``world_size`` ranks, train the tied model as a pipeline, train the same model
    written in plain torch (:class:`PlainModel`) in this process, and return both loss curves
    and the largest difference."""
    from hyperpar.testing import run_distributed

    results = run_distributed(train, world_size, steps=steps, n_microbatches=n_microbatches,
                              schedule=schedule, verbose=verbose)
    pipelined = next(r for r in results if r is not None)
    single = train_plain(steps=steps)
    diff = max(abs(a - b) for a, b in zip(pipelined, single, strict=True))
    if verbose:
        print(f"pipeline_tied: {world_size} ranks, loss {pipelined[0]:.4f} -> "
              f"{pipelined[-1]:.4f}; one process {single[0]:.4f} -> {single[-1]:.4f}; "
              f"max |diff| {diff:.2e}", flush=True)
    return {"pipeline": pipelined, "single_process": single, "max_abs_diff": diff}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--schedule", default="1f1b",
                        help="gpipe | 1f1b | zerobubble (interleaved: use --virtual-stages)")
    parser.add_argument("--ranks", type=int, default=2, help="ranks to spawn (not torchrun)")
    args = parser.parse_args()
    if "WORLD_SIZE" in os.environ:  # under torchrun / hyperpar run: one rank of the job
        from hyperpar.platform import get_platform

        platform = get_platform()
        platform.init_process_group()
        train(args.steps, n_microbatches=args.microbatches, schedule=args.schedule)
        platform.destroy_process_group()
        return 0
    out = demo(args.ranks, args.steps, args.microbatches, args.schedule)
    ok = out["max_abs_diff"] < 1e-4
    print("pipeline_tied: OK -- equal to the single-process run" if ok else
          "pipeline_tied: MISMATCH with the single-process run", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
