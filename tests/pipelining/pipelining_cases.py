"""One torch-pipelining training script, run with ``torch.distributed.pipelining`` and with
``hyperpar.pipelining`` (only the imported module differs), and the same model trained in one
process with plain torch. Worker functions return plain tensors for the test to compare."""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch import nn

from hyperpar.platform import get_platform

WIDTH, BATCH, LR = 8, 8, 0.1
V_SCHEDULES = ("ScheduleZBVZeroBubble",)
# torch 2.13-2.14's runtime schedules fail in eval() ("can't steal_bwd_input if this stage
# doesn't have backward"): their eval is compared with one process for hyperpar only
TORCH_EVAL_BROKEN = ("ScheduleZBVZeroBubble", "ScheduleInterleavedZeroBubble")


def build_model(n_stages: int) -> nn.Sequential:
    """The whole model: one Linear+Tanh block per stage, the same weights in every process."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())
                           for _ in range(n_stages)])


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, WIDTH, generator=gen), torch.randn(BATCH, WIDTH, generator=gen))
            for _ in range(steps)]


def mse_mean(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).pow(2).mean()


def mse_sum(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).pow(2).sum()


def reference(n_stages: int, m: int, steps: int, scale_grads: bool = True,
              loss: str = "mean") -> dict[str, Any]:
    """Plain torch, one process: per-microbatch losses; the gradient is their mean
    (``scale_grads``) or sum, as torch's pipelining defines it."""
    loss_fn = mse_mean if loss == "mean" else mse_sum
    model = build_model(n_stages)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for x, y in batches(steps):
        opt.zero_grad()
        mb = [loss_fn(model(xm), ym) for xm, ym in zip(x.tensor_split(m), y.tensor_split(m),
                                                       strict=True)]
        total = sum(mb) / (m if scale_grads else 1)
        total.backward()
        opt.step()
        losses.append([v.item() for v in mb])
    x0, y0 = batches(1)[0]
    with torch.no_grad():
        out = model(x0)
        eval_losses = [loss_fn(model(xm), ym).item()
                       for xm, ym in zip(x0.tensor_split(m), y0.tensor_split(m), strict=True)]
    return {"losses": losses, "params": {k: v.detach().clone()
                                         for k, v in model.state_dict().items()},
            "eval": out, "eval_losses": eval_losses}


def train(lib: str, schedule: str, m: int, steps: int, virtual: int = 1,
          scale_grads: bool = True, loss: str = "mean") -> dict[str, Any]:
    """The pipelining script: ``lib`` is ``torch.distributed.pipelining`` or
    ``hyperpar.pipelining``. Returns this rank's stage parameters (named as in the whole
    model), per-step losses and eval outputs (last stage)."""
    pp = importlib.import_module(lib)
    platform = get_platform()
    rank, world = platform.rank(), platform.world_size()
    device = platform.device()
    n_stages = world * virtual
    model = build_model(n_stages)
    if schedule in V_SCHEDULES:   # stages down the ranks and back: r and 2p - 1 - r
        indices = [rank, 2 * world - 1 - rank]
    else:
        indices = [rank + i * world for i in range(virtual)]
    stages = [pp.PipelineStage(model[i], i, n_stages, device) for i in indices]
    loss_fn = mse_mean if loss == "mean" else mse_sum
    cls = getattr(pp, schedule)
    sched = cls(stages[0] if virtual == 1 else stages, n_microbatches=m, loss_fn=loss_fn,
                scale_grads=scale_grads)
    params = [p for i in indices for p in model[i].parameters()]
    opt = torch.optim.SGD(params, lr=LR)
    all_losses, outs = [], []
    for x, y in batches(steps):
        opt.zero_grad()
        losses: list[torch.Tensor] = []
        first, last = 0 in indices, n_stages - 1 in indices
        out = sched.step(*((x,) if first else ()), target=y if last else None,
                         losses=losses if last else None)
        if last:
            all_losses.append([v.item() for v in losses])
            outs.append(out.detach())
        opt.step()
    x0, y0 = batches(1)[0]
    eval_losses: list[torch.Tensor] = []
    last = n_stages - 1 in indices
    if lib.startswith("torch") and schedule in TORCH_EVAL_BROKEN:
        params_out = {f"{i}.{k}": v.detach().clone() for i in indices
                      for k, v in model[i].state_dict().items()}
        return {"losses": all_losses, "params": params_out, "outputs": outs, "eval": None,
                "eval_losses": None}
    eval_out = sched.eval(*((x0,) if 0 in indices else ()), target=y0 if last else None,
                          losses=eval_losses if last else None)
    params_out = {f"{i}.{k}": v.detach().clone() for i in indices
                  for k, v in model[i].state_dict().items()}
    return {"losses": all_losses, "params": params_out, "outputs": outs,
            "eval": eval_out.detach() if eval_out is not None else None,
            "eval_losses": [v.item() for v in eval_losses]}


def both(schedule: str, m: int, steps: int, virtual: int = 1, scale_grads: bool = True,
         loss: str = "mean") -> dict[str, Any]:
    """The script with torch's pipelining, then with hyperpar's, on the same ranks."""
    return {lib: train(lib, schedule, m, steps, virtual, scale_grads, loss)
            for lib in ("torch.distributed.pipelining", "hyperpar.pipelining")}
