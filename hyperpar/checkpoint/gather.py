"""``full_state_dict``: plain, unsharded host tensors of a sharded model, gathered on rank 0."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hyperpar.platform import get_platform

from ._boxes import owned, pieces
from ._format import dtype_of

__all__ = ["full_state_dict"]


def full_state_dict(model: nn.Module | dict[str, Any], *, rank0_only: bool = True
                    ) -> dict[str, torch.Tensor]:
    """Plain, unsharded host tensors of ``model``'s state dict, gathered on rank 0.

    Works for any layout (TP shards, DP replicas, pipeline stages holding different layers,
    n-D meshes): each distinct box is sent to rank 0 once. Other ranks get ``{}`` (or, with
    ``rank0_only=False``, the same dict, broadcast). Collective.
    """
    platform = get_platform()
    rank, world = platform.rank(), platform.world_size()
    state = model.state_dict() if isinstance(model, nn.Module) else model
    held = pieces(state)
    mine, metas, _ = owned(held)
    out: dict[str, torch.Tensor] = {}
    if rank == 0:
        device = held[0].local.device if held else platform.device()
        order: list[str] = []
        sent: set[tuple] = set()
        for r, items in enumerate(metas):
            for m in items:
                key = m["key"]
                if key not in out:
                    out[key] = torch.empty(m["shape"], dtype=dtype_of(m["dtype"]))
                    order.append(key)
                box = (key, tuple(m["offset"]), tuple(m["local_shape"]))
                if box in sent or 0 in m["local_shape"]:
                    continue  # written by a lower rank already (the owner), or empty
                sent.add(box)
                if r == 0:
                    local = next(p.local for p in mine if p.box() == box)
                else:
                    local = torch.empty(m["local_shape"], dtype=dtype_of(m["dtype"]),
                                        device=device)
                    platform.recv(local, r)
                region = tuple(slice(o, o + n) for o, n in zip(m["offset"], m["local_shape"],
                                                               strict=True))
                out[key][region] = local.cpu()
        # Keep the model's own key order where rank 0 has it.
        out = {k: out[k] for k in list(state) + order if k in out}
    else:
        for p in mine:
            if p.local.numel():
                platform.send(p.local.contiguous(), 0)
    if not rank0_only and world > 1:
        out = platform.broadcast_object(out if rank == 0 else None, 0)
    return out
