"""A torch.distributed.pipelining script on hyperpar: only the import differs.

    hyperpar run -n 2 examples/torch_pipelining.py                    # hyperpar.pipelining, 1F1B
    hyperpar run -n 2 examples/torch_pipelining.py --schedule interleaved   # 2 stages per rank
    hyperpar run -n 2 examples/torch_pipelining.py --torch            # torch's own, to compare

A plain ``nn.Sequential`` MLP is cut into one block per stage; every rank builds the whole
model with the same seed and keeps its stages (stage ``s`` on rank ``s % world``). The last
stage prints the mean microbatch loss per step, then trains the same model in one process on
the same batches and prints the largest parameter difference of its stages.
"""

from __future__ import annotations

import argparse
import importlib

import torch
from torch import nn

from hyperpar.platform import get_platform

WIDTH, BATCH, LR = 16, 16, 0.05


def build(n_blocks: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())
                           for _ in range(n_blocks)])


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", choices=["gpipe", "1f1b", "interleaved"], default="1f1b")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--torch", action="store_true",
                        help="use torch.distributed.pipelining instead of hyperpar.pipelining")
    args = parser.parse_args()
    pp = importlib.import_module("torch.distributed.pipelining" if args.torch
                                 else "hyperpar.pipelining")
    platform = get_platform()
    if not platform.is_initialized():   # torch scripts call dist.init_process_group() here
        platform.init_process_group()
    rank, world = platform.rank(), platform.world_size()
    virtual = 2 if args.schedule == "interleaved" else 1
    n_stages = world * virtual
    model = build(n_stages)
    mine = [rank + i * world for i in range(virtual)]
    stages = [pp.PipelineStage(model[i], i, n_stages, platform.device()) for i in mine]
    cls = {"gpipe": pp.ScheduleGPipe, "1f1b": pp.Schedule1F1B,
           "interleaved": pp.ScheduleInterleaved1F1B}[args.schedule]
    schedule = cls(stages if virtual > 1 else stages[0], n_microbatches=args.microbatches,
                   loss_fn=loss_fn)
    opt = torch.optim.SGD([p for i in mine for p in model[i].parameters()], lr=LR)
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(BATCH, WIDTH, generator=gen), torch.randn(BATCH, WIDTH, generator=gen))
            for _ in range(args.steps)]
    first, last = 0 in mine, n_stages - 1 in mine
    for step, (x, y) in enumerate(data):
        opt.zero_grad()
        losses: list[torch.Tensor] = []
        schedule.step(*((x,) if first else ()), target=y if last else None,
                      losses=losses if last else None)
        opt.step()
        if last:
            print(f"step {step}: loss {torch.stack(losses).mean().item():.6f}", flush=True)
    if last:   # the same training in one process, plain torch
        ref = build(n_stages)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
        for x, y in data:
            ref_opt.zero_grad()
            sum(loss_fn(ref(xm), ym) for xm, ym in zip(x.tensor_split(args.microbatches),
                                                       y.tensor_split(args.microbatches),
                                                       strict=True)).div(args.microbatches
                                                                         ).backward()
            ref_opt.step()
        diff = max((p - q).abs().max().item() for i in mine
                   for p, q in zip(model[i].parameters(), ref[i].parameters(), strict=True))
        print(f"max |param - one-process param| on stages {mine}: {diff:.2e}", flush=True)


if __name__ == "__main__":
    main()
