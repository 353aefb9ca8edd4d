"""A MindSpore optimizer's saved state loaded into the torch optimizer of the same update
(:mod:`.optim_map` has the pairs): ``moment1``/``moment2`` -> ``exp_avg``/``exp_avg_sq`` with
``step`` from ``global_step``, ``moments`` or ``accum`` -> ``momentum_buffer``. The state
entries are laid out as their parameters, so they are read through the same boxes as
hyperpar's own (any saved layout into any current one)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ._format import CheckpointError
from ._optim_params import class_name, optimizer_params, read_like
from ._read import Reader, assemble
from .optim_map import (
    MS_SGD,
    Pair,
    check_groups,
    find_pair,
    step_from_mindspore,
    torch_hyperparameters,
)


def _hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each param group's hyperparameters by :mod:`.optim_map`'s names (tensors as floats)."""
    out = []
    for group in optimizer.param_groups:
        plain = {k: (float(v) if isinstance(v, torch.Tensor) else v) for k, v in group.items()
                 if k != "params"}
        if "betas" in plain:
            plain["betas"] = tuple(float(b) for b in plain["betas"])
        out.append(torch_hyperparameters(plain))
    return out


def _saved_hyperparameters(extra: dict[str, Any], path: str) -> dict[str, Any]:
    saved = extra.get("hyperparameters")
    if saved is None:
        raise CheckpointError(
            f"load(optimizer=...): {path} holds the state of a {extra.get('class')} saved "
            "without its hyperparameters (an older hyperpar); load it with that optimizer in "
            "MindSpore and save again to translate it")
    return saved


def check_translated(optimizer: torch.optim.Optimizer, extra: dict[str, Any], path: str
                     ) -> Pair:
    """The pair translating ``extra`` (a MindSpore optimizer's index section) into
    ``optimizer``, after refusing what the pair cannot run; warns about hyperparameters set
    differently (the loading optimizer's are kept). Reads no tensor."""
    pair = find_pair(extra["class"], class_name(optimizer), path)
    saved = _saved_hyperparameters(extra, path)
    groups = [(f"param group {i} of this {pair.torch}", mine)
              for i, mine in enumerate(_hyperparameters(optimizer))]
    check_groups(pair, [(f"the saved {pair.mindspore}", saved)], groups, path)
    return pair


def _scalar(index: dict[str, Any], name: str, reader: Reader, path: str) -> float:
    key = f"optimizer.{name}"
    entry = index["tensors"].get(key)
    if entry is None:
        raise CheckpointError(f"load(optimizer=...): {path} lacks {key!r}, which MindSpore's "
                              f"{index['optimizer']['class']} saves")
    shape = entry["shape"]
    return assemble(entry, key, [0] * len(shape), shape, reader).reshape(-1)[0].item()


def load_translated(model: nn.Module, optimizer: torch.optim.Optimizer, index: dict[str, Any],
                    reader: Reader, path: str) -> None:
    """Restore ``optimizer``'s state from a MindSpore optimizer's, resharded like its
    parameters; the hyperparameters stay ``optimizer``'s."""
    extra = index["optimizer"]
    pair = find_pair(extra["class"], class_name(optimizer), path)
    hyper = extra["hyperparameters"]
    saved = index["tensors"]
    global_step = int(_scalar(index, "global_step", reader, path))
    if pair.kind == "adam":
        step = step_from_mindspore(global_step, _scalar(index, "beta1_power", reader, path),
                                   hyper["beta1"], path)
        stepped = step > 0
    else:  # a MindSpore buffer is a momentum buffer only under momentum > 0
        stepped = global_step > 0 and float(hyper.get("momentum", 0.0)) > 0
    state: dict[int, dict[str, Any]] = {}
    for i, (name, param) in enumerate(optimizer_params(model, optimizer)):
        if not stepped:
            break
        entry_state: dict[str, Any] = {}
        for torch_key, prefix in pair.state:
            key = f"optimizer.{name}.{prefix}"
            if key not in saved:
                raise CheckpointError(f"load(optimizer=...): {path} lacks {key!r}: the "
                                      f"{pair.mindspore} that saved it did not hold parameter "
                                      f"{name!r}")
            entry_state[torch_key] = read_like(param, saved[key], key, reader)
        if pair.mindspore == MS_SGD and _never_stepped(param, name, saved, reader):
            continue  # nn.SGD's stat stays 1 until a parameter's first step: no buffer yet
        if pair.kind == "adam":
            entry_state["step"] = torch.tensor(float(step), dtype=torch.float32)
        state[i] = entry_state
    optimizer.load_state_dict({"state": state,
                               "param_groups": optimizer.state_dict()["param_groups"]})


def _never_stepped(param: torch.Tensor, name: str, saved: dict[str, Any], reader: Reader
                   ) -> bool:
    key = f"optimizer.{name}.stat"
    if key not in saved:
        return False
    stat = read_like(param, saved[key], key, reader)
    local = stat.to_local() if hasattr(stat, "to_local") else stat
    return bool(local.numel()) and bool((local != 0).all())
