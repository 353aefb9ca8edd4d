"""Optimizer state in a checkpoint: per-parameter tensors laid out like their parameter
(entries ``optimizer.<param name>.<state key>``), hyperparameters and scalars in the index."""

from __future__ import annotations

import json
from typing import Any

import torch
from torch import nn

from ._boxes import is_dtensor
from ._read import Reader, assemble

OPTIM_PREFIX = "optimizer."


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


def _json_safe(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer
                    ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The optimizer's tensor state keyed ``optimizer.<param>.<key>`` (a state tensor of a
    DTensor parameter's local shape is given the parameter's layout), and the rest:
    ``{"param_groups": [hyperparameters...], "scalars": {key: value}}``."""
    osd = optimizer.state_dict()
    tensors: dict[str, Any] = {}
    scalars: dict[str, Any] = {}
    for index, (name, param) in enumerate(optimizer_params(model, optimizer)):
        for k, v in osd["state"].get(index, {}).items():
            key = f"{OPTIM_PREFIX}{name}.{k}"
            if isinstance(v, torch.Tensor):
                if (is_dtensor(param) and not is_dtensor(v) and v.ndim
                        and tuple(v.shape) == tuple(param.to_local().shape)):
                    v = type(param).from_local(v, param.device_mesh, param.placements,
                                               shape=param.shape)
                tensors[key] = v
            elif _json_safe(v):
                scalars[key] = v
    groups = [{k: v for k, v in g.items() if k != "params" and _json_safe(v)}
              for g in osd["param_groups"]]
    return tensors, {"param_groups": groups, "scalars": scalars}


def merge_extras(extras: list[dict[str, Any]], tensor_keys: list[str]) -> dict[str, Any]:
    """The index's ``"optimizer"`` section from every rank's non-tensor state."""
    scalars: dict[str, Any] = {}
    for e in extras:
        for key, value in e["scalars"].items():
            scalars.setdefault(key, value)
    return {"param_groups": extras[0]["param_groups"], "scalars": scalars,
            "tensors": sorted(tensor_keys)}


def optimizer_keys(index: dict[str, Any]) -> set[str]:
    """The index entries that hold optimizer state (not model state)."""
    extra = index.get("optimizer")
    if extra is None:
        return set()
    if "tensors" in extra:
        return set(extra["tensors"])
    return {k for k in index["tensors"] if k.startswith(OPTIM_PREFIX)}  # format version 1


def load_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, index: dict[str, Any],
                   reader: Reader, path: str) -> None:
    """Restore ``optimizer``'s state from the checkpoint, resharded like its parameters."""
    saved = index["tensors"]
    extra = index["optimizer"]
    state: dict[int, dict[str, Any]] = {}
    for i, (name, param) in enumerate(optimizer_params(model, optimizer)):
        prefix = f"{OPTIM_PREFIX}{name}."
        entry_state: dict[str, Any] = {}
        for key, entry in saved.items():
            if not key.startswith(prefix) or "." in key[len(prefix):]:
                continue
            k = key[len(prefix):]
            if is_dtensor(param) and entry["shape"] == list(param.shape) and param.ndim:
                local_shape, offset = param._spec.local_shape_and_offset()
                box = assemble(entry, key, list(offset), list(local_shape), reader)
                entry_state[k] = type(param).from_local(
                    box.to(param.device), param.device_mesh, param.placements,
                    shape=param.shape)
            else:
                shape = entry["shape"]
                entry_state[k] = assemble(entry, key, [0] * len(shape), shape, reader)
        for key, value in extra["scalars"].items():
            if key.startswith(prefix) and "." not in key[len(prefix):]:
                entry_state[key[len(prefix):]] = value
        if entry_state:
            state[i] = entry_state
    groups = optimizer.state_dict()["param_groups"]
    if len(extra["param_groups"]) == len(groups):
        groups = [{**g, **saved_g} for g, saved_g in zip(groups, extra["param_groups"],
                                                          strict=True)]
    optimizer.load_state_dict({"state": state, "param_groups": groups})
