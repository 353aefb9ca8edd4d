"""What the compile tests count and how they step: dynamo's graph breaks and graphs, and one
training step checked against the one-process reference before both optimizers step."""
from __future__ import annotations

import torch

from hyperpar.testing.parity import assert_close_to_reference


def reset_dynamo() -> None:
    """Forget compiled code and dynamo's counters (``reset`` alone keeps the counters)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()


def dynamo_counts() -> tuple[int, int]:
    """(graph breaks + frames dynamo gave up on and ran eagerly, unique graphs) since the last
    :func:`reset_dynamo`."""
    from torch._dynamo.utils import counters

    frames = counters["frames"]
    skipped = frames["total"] - frames["ok"]
    return sum(counters["graph_break"].values()) + skipped, counters["stats"]["unique_graphs"]


def check_grads_then_step(grads: dict[str, torch.Tensor], ref_grads: dict[str, torch.Tensor],
                          step: int, *optimizers: torch.optim.Optimizer) -> None:
    """Gradients compared before any optimizer step (AdamW would amplify rounding), then every
    optimizer steps and zeroes its gradients."""
    assert_close_to_reference(grads, ref_grads, what=f"step {step} grads")
    for opt in optimizers:
        opt.step()
    for opt in optimizers:
        opt.zero_grad()
