"""``load_safetensors``: a full (unsharded) safetensors checkpoint, such as a Hugging Face
``model.safetensors``, into a sharded model; each rank reads only the slices it holds."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hyperpar.platform import get_platform

from ._boxes import copy_box, local_box
from ._format import CheckpointError, CorruptCheckpointError, LoadResult
from ._validate import confined_file, regular_file
from .loader import agree_or_raise, show_keys

__all__ = ["load_safetensors"]

HF_INDEX = "model.safetensors.index.json"


def load_safetensors(model: nn.Module, path: str | os.PathLike, *, strict: bool = True,
                     key_map: Callable[[str], str] | None = None) -> LoadResult:
    """Load full tensors from safetensors file(s) into ``model``, whatever its layout.

    ``path`` is a ``.safetensors`` file, or a folder holding ``model.safetensors`` or a
    Hugging Face ``model.safetensors.index.json`` with the files it names. Each rank opens the
    files lazily and reads, per model tensor, only its own box (``safe_open(...).get_slice``):
    a Shard(0)-on-N parameter costs each rank 1/N of the bytes. Values are cast to the model's
    dtype. ``key_map(model_key) -> file_key`` renames; ``strict`` as in :func:`load` (missing
    and unexpected keys raise on every rank). A tied parameter (``lm_head.weight`` that *is*
    ``embed.weight``) is not missing when the file holds it under one of its names. Collective.
    """
    state = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    names = {k: (key_map(k) if key_map else k) for k in state}
    opened = _Files()
    problems = []
    # The files are untrusted: every rank checks the paths and headers before reading tensor
    # data, and all ranks share the outcome (none reads, none waits, when one fails).
    error: Exception | None = None
    try:
        files = _weight_map(os.fspath(path))
        for key, value in state.items():
            name = names[key]
            if name in files:
                shape = opened.shape(files[name], name)
                if shape != list(value.shape):
                    problems.append(f"{key!r} has global shape {list(value.shape)} in the "
                                    f"model but {shape} in {files[name]}")
    except Exception as exc:  # shared below: no rank waits for one that failed alone
        error = exc
    agree_or_raise(error)
    found = {k for k, n in names.items() if n in files}
    tied_found = {k for group in _tied(model) if found & set(group) for k in group}
    gathered = get_platform().all_gather_object(
        (sorted(names[k] for k in found), sorted(set(state) - found - tied_found), problems))
    used = {n for g in gathered for n in g[0]}
    missing = sorted({k for g in gathered for k in g[1]})
    unexpected = sorted(set(files) - used)
    problems = sorted({p for g in gathered for p in g[2]})
    if strict and missing:
        problems.append(f"{len(missing)} tensor(s) of the model are not in {path}: "
                        f"{show_keys(missing)}")
    if strict and unexpected:
        problems.append(f"{len(unexpected)} tensor(s) in {path} are not in the model: "
                        f"{show_keys(unexpected)}")
    if problems:
        raise CheckpointError("load_safetensors: " + "; ".join(problems))
    error = None
    try:
        with torch.no_grad():
            for key, value in state.items():
                if names[key] in files:
                    copy_box(value, read_region(opened, files[names[key]], names[key], value))
    except Exception as exc:  # shared below, so no rank waits for one that failed
        error = exc
    agree_or_raise(error)
    return LoadResult(missing, unexpected)


def _tied(model: nn.Module) -> list[list[str]]:
    """Names that share one parameter (weight tying), in groups of two or more."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return [g for g in groups.values() if len(g) > 1]


def _weight_map(path: str) -> dict[str, str]:
    """tensor name -> the file holding it; every file confined to ``path``'s folder and
    regular."""
    if os.path.isdir(path):
        index = os.path.join(path, HF_INDEX)
        if os.path.lexists(index):
            regular_file(index, what="load_safetensors")
            try:
                with open(index) as f:
                    weight_map = json.load(f).get("weight_map")
            except (ValueError, AttributeError) as exc:
                raise CheckpointError(f"{index} is not a JSON object ({exc}); it is not a "
                                      "Hugging Face safetensors index") from exc
            if not isinstance(weight_map, dict) or not all(
                    isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
                raise CheckpointError(f"{index} is malformed: \"weight_map\" must be an "
                                      "object of tensor name -> file name")
            full = {v: confined_file(path, v, what=index) for v in set(weight_map.values())}
            return {k: full[v] for k, v in weight_map.items()}
        single = os.path.join(path, "model.safetensors")
        if not os.path.lexists(single):
            raise FileNotFoundError(f"load_safetensors: {path} holds neither {HF_INDEX} nor "
                                    "model.safetensors")
        path = confined_file(path, "model.safetensors", what="load_safetensors")
    if not os.path.exists(path):
        raise FileNotFoundError(f"load_safetensors: {path} does not exist")
    regular_file(path, what="load_safetensors")
    return dict.fromkeys(_Files().keys(path), path)


class _Files:
    """Open safetensors handles, one per file."""

    def __init__(self) -> None:
        self._open: dict[str, Any] = {}
        self._keys: dict[str, set[str]] = {}

    def handle(self, file: str) -> Any:
        if file not in self._open:
            from safetensors import safe_open

            try:
                self._open[file] = safe_open(file, framework="pt")
            except Exception as exc:
                raise CorruptCheckpointError(f"{file} cannot be opened as safetensors "
                                             f"({type(exc).__name__}: {exc})") from exc
        return self._open[file]

    def keys(self, file: str) -> list[str]:
        return list(self.handle(file).keys())

    def shape(self, file: str, name: str) -> list[int]:
        handle = self.handle(file)
        if file not in self._keys:
            self._keys[file] = set(handle.keys())
        if name not in self._keys[file]:
            raise CorruptCheckpointError(f"{file} holds no tensor {name!r}, but the index "
                                         "names this file for it")
        return list(handle.get_slice(name).get_shape())


def read_region(files: _Files, file: str, name: str, value: torch.Tensor) -> torch.Tensor:
    """This rank's box of tensor ``name`` (a slice read; the rest of the tensor is not read)."""
    offset, shape, _ = local_box(value)
    region = tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
    try:
        sl = files.handle(file).get_slice(name)
        return sl[region] if region else files.handle(file).get_tensor(name)
    except CheckpointError:
        raise
    except Exception as exc:
        raise CorruptCheckpointError(f"{file}: cannot read {name!r} ({type(exc).__name__}: "
                                     f"{exc}); the file may be truncated") from exc
