"""Optimizer state in a checkpoint: per-parameter tensors laid out like their parameter
(entries ``optimizer.<param name>.<state key>``), hyperparameters and scalars in the index."""

from __future__ import annotations

import json
from typing import Any

import torch
from torch import nn

from ._boxes import is_dtensor
from ._format import CheckpointError
from ._optim_params import class_name, optimizer_params, read_like
from ._read import Reader
from .optim_map import is_mindspore

OPTIM_PREFIX = "optimizer."


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
    state_keys = sorted({k for st in osd["state"].values() for k in st})
    return tensors, {"param_groups": groups, "scalars": scalars, "class": class_name(optimizer),
                     "state_keys": state_keys, "tensor_keys": sorted(tensors)}


def merge_extras(extras: list[dict[str, Any]]) -> dict[str, Any]:
    """The index's ``"optimizer"`` section from every rank's non-tensor state: rank 0's
    hyperparameters, every rank's scalars and tensor keys (pipeline stages differ), the class
    and the state keys it keeps per parameter (checked on load)."""
    scalars: dict[str, Any] = {}
    for e in extras:
        for key, value in e["scalars"].items():
            scalars.setdefault(key, value)
    return {"class": extras[0]["class"], "param_groups": extras[0]["param_groups"],
            "state_keys": sorted({k for e in extras for k in e["state_keys"]}),
            "scalars": scalars, "tensors": sorted({k for e in extras for k in e["tensor_keys"]})}


def check_optimizer(optimizer: torch.optim.Optimizer, index: dict[str, Any], path: str) -> None:
    """Refuse state saved by another optimizer type (a MindSpore optimizer's is checked by
    :func:`.optim_cross.check_translated`), with another number of parameter groups, or
    keeping other per-parameter state than ``optimizer`` already keeps."""
    extra = index.get("optimizer")
    if extra is None:
        raise CheckpointError(f"load(optimizer=...): {path} holds no optimizer state (save it "
                              "with save(model, path, optimizer=optimizer))")
    mine = class_name(optimizer)
    saved = extra.get("class")  # absent in checkpoints written before it was recorded
    if saved is not None and saved != mine and is_mindspore(saved):
        from .optim_cross import check_translated

        check_translated(optimizer, extra, path)   # a pair of the table, or refused
        return
    if saved is not None and saved != mine:
        raise CheckpointError(
            f"load(optimizer=...): {path} holds the state of a {saved} but the optimizer given "
            f"is a {mine}; build the optimizer type that saved it, or load without optimizer= "
            "and start its state afresh")
    groups = len(optimizer.param_groups)
    if len(extra["param_groups"]) != groups:
        raise CheckpointError(
            f"load(optimizer=...): {path} holds {len(extra['param_groups'])} parameter group(s) "
            f"but the optimizer has {groups}; build it with the same groups as when saved")
    have = sorted({k for st in optimizer.state_dict()["state"].values() for k in st})
    want = extra.get("state_keys")
    if have and want is not None and have != want:
        raise CheckpointError(
            f"load(optimizer=...): {path} keeps the per-parameter state {want} but the "
            f"optimizer keeps {have} (other options, e.g. momentum or amsgrad?); build it as "
            "when saved")


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
    """Restore ``optimizer``'s state from the checkpoint, resharded like its parameters (a
    MindSpore optimizer's state translated: :mod:`.optim_cross`)."""
    if is_mindspore(index["optimizer"].get("class")):
        from .optim_cross import load_translated

        load_translated(model, optimizer, index, reader, path)
        return
    saved = index["tensors"]
    extra = index["optimizer"]
    state: dict[int, dict[str, Any]] = {}
    for i, (name, param) in enumerate(optimizer_params(model, optimizer)):
        prefix = f"{OPTIM_PREFIX}{name}."
        entry_state: dict[str, Any] = {}
        for key, entry in saved.items():
            if not key.startswith(prefix) or "." in key[len(prefix):]:
                continue
            entry_state[key[len(prefix):]] = read_like(param, entry, key, reader)
        for key, value in extra["scalars"].items():
            if key.startswith(prefix) and "." not in key[len(prefix):]:
                entry_state[key[len(prefix):]] = value
        if entry_state:
            state[i] = entry_state
    groups = optimizer.state_dict()["param_groups"]  # as many as saved (check_optimizer)
    groups = [_saved_hyperparameters(g, saved_g, path)
              for g, saved_g in zip(groups, extra["param_groups"], strict=True)]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _saved_hyperparameters(group: dict[str, Any], saved: dict[str, Any], path: str
                           ) -> dict[str, Any]:
    """``group`` with the saved hyperparameters (never ``params``); a saved value of another
    type than the optimizer's own is refused, not passed on."""
    out = dict(group)
    for k, v in saved.items():
        if k == "params":
            continue
        if k not in group:  # e.g. "initial_lr" of an LR scheduler not built yet
            out[k] = v
            continue
        mine = group[k]
        number = (int, float)
        same = (isinstance(v, bool) == isinstance(mine, bool)
                and (isinstance(v, number) and isinstance(mine, number)
                     or v is None or mine is None or type(v) is type(mine)
                     or isinstance(v, list) and isinstance(mine, tuple)))
        if not same:
            raise CheckpointError(
                f"load(optimizer=...): {path} sets hyperparameter {k!r} to {v!r} but the "
                f"optimizer's is {mine!r} ({type(mine).__name__}); the index was edited or "
                "another optimizer saved it")
        out[k] = tuple(v) if isinstance(mine, tuple) else v
    return out
