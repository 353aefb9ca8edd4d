"""The pieces of optimizer checkpointing that both :mod:`.optim` (torch optimizers) and
:mod:`.optim_cross` (MindSpore optimizers' state into torch ones) use: the parameters in the
optimizer's order, the class name recorded in the index, and reading a saved state tensor laid
out like its parameter. A module of its own, so that neither of the two imports the other."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ._boxes import is_dtensor
from ._read import Reader, assemble

__all__ = ["class_name", "optimizer_params", "read_like"]


def optimizer_params(model: nn.Module, optimizer: torch.optim.Optimizer
                     ) -> list[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` in the optimizer's state-dict index order."""
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError("checkpoint: the optimizer holds a parameter that is not in "
                                 f"the model (shape {tuple(p.shape)})")
            out.append((names[id(p)], p))
    return out


def class_name(optimizer: torch.optim.Optimizer) -> str:
    cls = type(optimizer)
    return f"{cls.__module__}.{cls.__qualname__}"


def read_like(param: torch.Tensor, entry: dict[str, Any], key: str, reader: Reader
              ) -> torch.Tensor:
    """Saved tensor ``key``: this rank's box of it as a DTensor laid out like ``param`` when it
    has ``param``'s global shape (per-parameter state), else the whole tensor."""
    if is_dtensor(param) and entry["shape"] == list(param.shape) and param.ndim:
        local_shape, offset = param._spec.local_shape_and_offset()
        box = assemble(entry, key, list(offset), list(local_shape), reader)
        return type(param).from_local(box.to(param.device), param.device_mesh,
                                      param.placements, shape=param.shape)
    shape = entry["shape"]
    return assemble(entry, key, [0] * len(shape), shape, reader)
