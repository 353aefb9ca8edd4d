"""Sharded checkpoints: every rank writes the pieces it holds; load reshards to any layout.

Layout of a checkpoint folder::

    index.json                      what every tensor is and where its pieces live
    shard-00000-of-00004.safetensors  rank 0's pieces (".pt" when safetensors is not installed)
    ...

``index.json``::

    {"format": "hyperpar-checkpoint", "version": 1, "file_format": "safetensors",
     "world_size": 4,
     "tensors": {"layers.0.mlp.up.weight": {
         "shape": [64, 16], "dtype": "float32",
         "placements": ["Shard(dim=0)"], "mesh_shape": [2],        # how it was laid out (info)
         "chunks": [{"file": "shard-00000-of-00004.safetensors", "key": "layers.0.mlp.up.weight",
                     "offset": [0, 0], "shape": [32, 16]}, ...]}}}

A *chunk* is a box of the global tensor: ``offset`` (global start per dim) and ``shape``. Every
distinct box is written exactly once, by the lowest global rank that holds it, so replicas
(DP replicas, Replicate placements, tied weights on several pipeline stages) cost one copy.
Plain tensors are one box covering the whole tensor. Partial placements are reduced first.

Loading needs no knowledge of the saving layout: for each tensor of the model's *current*
``state_dict`` the loader computes the box this rank holds (a DTensor's local shard, or the
whole tensor) and copies in the overlap of every saved chunk that intersects it. So tp2 -> tp1,
tp1 -> tp2, or pipeline stages regrouped (layer names are global) all load the same way.

Every function here is collective: all ranks of the world call it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from hyperpar.platform import get_platform

__all__ = ["full_state_dict", "load", "save", "read_index", "INDEX_FILE"]

INDEX_FILE = "index.json"
FORMAT = "hyperpar-checkpoint"
VERSION = 1


def _safetensors() -> Any:
    try:
        import safetensors.torch as st
    except ImportError:
        return None
    return st


def _is_dtensor(t: Any) -> bool:
    return hasattr(t, "placements") and hasattr(t, "to_local") and hasattr(t, "device_mesh")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"checkpoint index names an unknown dtype {name!r}")
    return dtype


class _Piece:
    """One box of one state-dict entry held by this rank."""

    __slots__ = ("key", "shape", "dtype", "offset", "local", "placements", "mesh_shape")

    def __init__(self, key: str, shape: tuple[int, ...], dtype: torch.dtype,
                 offset: tuple[int, ...], local: torch.Tensor, placements: list[str],
                 mesh_shape: list[int]) -> None:
        self.key, self.shape, self.dtype, self.offset = key, shape, dtype, offset
        self.local, self.placements, self.mesh_shape = local, placements, mesh_shape

    def box(self) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
        return self.key, self.offset, tuple(self.local.shape)

    def meta(self) -> dict[str, Any]:
        return {"key": self.key, "shape": list(self.shape), "dtype": _dtype_name(self.dtype),
                "offset": list(self.offset), "local_shape": list(self.local.shape),
                "placements": self.placements, "mesh_shape": self.mesh_shape}


def _without_partial(t: Any) -> Any:
    if not any(p.is_partial() for p in t.placements):
        return t
    from hyperpar.dtensor.placement import Replicate

    return t.redistribute(t.device_mesh,
                          [Replicate() if p.is_partial() else p for p in t.placements])


def _pieces(state: dict[str, Any]) -> list[_Piece]:
    """This rank's boxes of every tensor in ``state`` (collective if a Partial is reduced)."""
    pieces = []
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            continue
        if _is_dtensor(value):
            value = _without_partial(value)
            shape = tuple(value.shape)
            local_shape, offset = value._spec.local_shape_and_offset()
            local = value.to_local().detach()
            if tuple(local.shape) != tuple(local_shape):
                raise ValueError(
                    f"checkpoint: {key!r} has local shape {tuple(local.shape)} but its layout "
                    f"{value.placements} over mesh {value.device_mesh.shape} gives {local_shape}"
                )
            pieces.append(_Piece(key, shape, local.dtype, tuple(offset), local,
                                 [repr(p) for p in value.placements],
                                 list(value.device_mesh.shape)))
        else:
            t = value.detach()
            pieces.append(_Piece(key, tuple(t.shape), t.dtype, (0,) * t.ndim, t, [], []))
    return pieces


def _owned(pieces: list[_Piece]) -> tuple[list[_Piece], list[list[dict[str, Any]]]]:
    """The pieces this rank writes (lowest rank holding a box writes it) and every rank's
    metadata."""
    platform = get_platform()
    rank = platform.rank()
    metas = platform.all_gather_object([p.meta() for p in pieces])
    owner: dict[tuple, int] = {}
    for r, items in enumerate(metas):
        for m in items:
            box = (m["key"], tuple(m["offset"]), tuple(m["local_shape"]))
            owner.setdefault(box, r)
    mine = [p for p in pieces if owner[p.box()] == rank]
    return mine, metas


def _host(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Contiguous host copies, no two sharing storage (safetensors refuses shared storage)."""
    out, seen = [], set()
    for t in tensors:
        h = t.cpu().contiguous()
        ptr = h.untyped_storage().data_ptr()
        if ptr in seen or h.untyped_storage().nbytes() != h.numel() * h.element_size():
            h = h.clone()
        seen.add(h.untyped_storage().data_ptr())
        out.append(h)
    return out


OPTIM_PREFIX = "optimizer."


def _optimizer_params(model: nn.Module, optimizer: torch.optim.Optimizer
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


def _optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer
                     ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The optimizer's tensor state keyed ``optimizer.<param>.<key>`` (a state tensor of a
    DTensor parameter's local shape is given the parameter's layout), and the rest:
    ``{"param_groups": [hyperparameters...], "scalars": {key: value}}``."""
    osd = optimizer.state_dict()
    tensors: dict[str, Any] = {}
    scalars: dict[str, Any] = {}
    for index, (name, param) in enumerate(_optimizer_params(model, optimizer)):
        for k, v in osd["state"].get(index, {}).items():
            key = f"{OPTIM_PREFIX}{name}.{k}"
            if isinstance(v, torch.Tensor):
                if (_is_dtensor(param) and not _is_dtensor(v) and v.ndim
                        and tuple(v.shape) == tuple(param.to_local().shape)):
                    v = type(param).from_local(v, param.device_mesh, param.placements,
                                               shape=param.shape)
                tensors[key] = v
            elif _json_safe(v):
                scalars[key] = v
    groups = [{k: v for k, v in g.items() if k != "params" and _json_safe(v)}
              for g in osd["param_groups"]]
    return tensors, {"param_groups": groups, "scalars": scalars}


def _load_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, index: dict[str, Any],
                    reader: _Reader, path: str) -> None:
    saved = index["tensors"]
    extra = index.get("optimizer")
    if extra is None:
        raise KeyError(f"load(optimizer=...): {path} holds no optimizer state (save it with "
                       "save(model, path, optimizer=optimizer))")
    state: dict[int, dict[str, Any]] = {}
    for i, (name, param) in enumerate(_optimizer_params(model, optimizer)):
        prefix = f"{OPTIM_PREFIX}{name}."
        entry_state: dict[str, Any] = {}
        for key, entry in saved.items():
            if not key.startswith(prefix) or "." in key[len(prefix):]:
                continue
            k = key[len(prefix):]
            if _is_dtensor(param) and entry["shape"] == list(param.shape) and param.ndim:
                local_shape, offset = param._spec.local_shape_and_offset()
                box = _assemble(entry, key, list(offset), list(local_shape), reader)
                entry_state[k] = type(param).from_local(
                    box.to(param.device), param.device_mesh, param.placements,
                    shape=param.shape)
            else:
                shape = entry["shape"]
                entry_state[k] = _assemble(entry, key, [0] * len(shape), shape, reader)
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


def save(model: nn.Module | dict[str, Any], path: str | os.PathLike, *,
         optimizer: torch.optim.Optimizer | None = None, file_format: str = "auto") -> str:
    """Write ``model``'s state dict (or a state dict) as a sharded checkpoint folder ``path``.

    Collective. Each rank writes one file with the boxes it is the first to hold; rank 0 writes
    ``index.json``. With ``optimizer``, its per-parameter state is saved too, laid out like the
    parameter (entries ``optimizer.<param name>.<state key>``), so it reshards on load like the
    model; its hyperparameters and non-tensor state go into the index. ``file_format``:
    ``"safetensors"``, ``"torch"`` (``torch.save``) or ``"auto"`` (safetensors when installed).
    Returns the index path.
    """
    platform = get_platform()
    rank, world = platform.rank(), platform.world_size()
    st = _safetensors()
    if file_format == "auto":
        file_format = "safetensors" if st is not None else "torch"
    if file_format not in ("safetensors", "torch"):
        raise ValueError(f"save: file_format must be 'auto', 'safetensors' or 'torch', got "
                         f"{file_format!r}")
    if file_format == "safetensors" and st is None:
        raise ImportError("save(file_format='safetensors') needs `pip install safetensors`")
    state = model.state_dict() if isinstance(model, nn.Module) else model
    extras: dict[str, Any] = {}
    if optimizer is not None:
        if not isinstance(model, nn.Module):
            raise TypeError("save(optimizer=...) needs the model itself, not a state dict")
        opt_tensors, extras = _optimizer_state(model, optimizer)
        state = {**state, **opt_tensors}
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    mine, metas = _owned(_pieces(state))
    all_extras = platform.all_gather_object(extras) if optimizer is not None else []
    ext = ".safetensors" if file_format == "safetensors" else ".pt"
    name = f"shard-{rank:05d}-of-{world:05d}{ext}"
    names = [f"{p.key}@{','.join(map(str, p.offset))}" for p in mine]
    tensors = dict(zip(names, _host(p.local for p in mine), strict=True))
    if file_format == "safetensors":
        st.save_file(tensors, os.path.join(path, name), metadata={"format": FORMAT})
    else:
        torch.save(tensors, os.path.join(path, name))
    files = platform.all_gather_object(name)
    if rank == 0:
        index: dict[str, Any] = {"format": FORMAT, "version": VERSION,
                                 "file_format": file_format, "world_size": world,
                                 "tensors": {}}
        entries = index["tensors"]
        written: set[tuple] = set()
        for r, items in enumerate(metas):
            for m in items:
                key = m["key"]
                entry = entries.setdefault(key, {
                    "shape": m["shape"], "dtype": m["dtype"], "placements": m["placements"],
                    "mesh_shape": m["mesh_shape"], "chunks": []})
                if entry["shape"] != m["shape"]:
                    raise ValueError(f"save: {key!r} has global shape {m['shape']} on rank {r} "
                                     f"but {entry['shape']} on a lower rank")
                box = (key, tuple(m["offset"]), tuple(m["local_shape"]))
                if box in written:
                    continue
                written.add(box)
                entry["chunks"].append({
                    "file": files[r], "key": f"{key}@{','.join(map(str, m['offset']))}",
                    "offset": m["offset"], "shape": m["local_shape"], "rank": r})
        if optimizer is not None:
            scalars: dict[str, Any] = {}
            for e in all_extras:
                for key, value in e["scalars"].items():
                    scalars.setdefault(key, value)
            index["optimizer"] = {"param_groups": all_extras[0]["param_groups"],
                                  "scalars": scalars}
        tmp = os.path.join(path, INDEX_FILE + ".tmp")
        with open(tmp, "w") as f:
            json.dump(index, f, indent=1)
        os.replace(tmp, os.path.join(path, INDEX_FILE))
    platform.barrier()
    return os.path.join(path, INDEX_FILE)


def read_index(path: str | os.PathLike) -> dict[str, Any]:
    """The parsed ``index.json`` of checkpoint folder ``path``."""
    file = os.path.join(os.fspath(path), INDEX_FILE)
    if not os.path.exists(file):
        raise FileNotFoundError(f"{file} does not exist: {os.fspath(path)!r} is not a hyperpar "
                                "checkpoint folder (written by hyperpar.checkpoint.save)")
    with open(file) as f:
        index = json.load(f)
    if index.get("format") != FORMAT:
        raise ValueError(f"{file} is not a hyperpar checkpoint index (format="
                         f"{index.get('format')!r}, expected {FORMAT!r})")
    return index


class _Reader:
    """Opens shard files lazily and reads boxes out of them."""

    def __init__(self, path: str, file_format: str) -> None:
        self.path, self.file_format = path, file_format
        self._open: dict[str, Any] = {}

    def read(self, file: str, key: str, region: tuple[slice, ...]) -> torch.Tensor:
        handle = self._open.get(file)
        if handle is None:
            full = os.path.join(self.path, file)
            if self.file_format == "safetensors":
                from safetensors import safe_open

                handle = safe_open(full, framework="pt")
            else:
                handle = torch.load(full, mmap=True, weights_only=True)
            self._open[file] = handle
        if self.file_format == "safetensors":
            return handle.get_slice(key)[region] if region else handle.get_tensor(key)
        return handle[key][region]


def _overlap(a_off: list[int], a_shape: list[int], b_off: list[int], b_shape: list[int]
             ) -> tuple[list[int], list[int]] | None:
    lo = [max(x, y) for x, y in zip(a_off, b_off, strict=True)]
    hi = [min(x + n, y + m) for x, n, y, m in zip(a_off, a_shape, b_off, b_shape, strict=True)]
    if any(h <= low for low, h in zip(lo, hi, strict=True)):
        return None
    return lo, hi


def _assemble(entry: dict[str, Any], key: str, offset: list[int], shape: list[int],
              reader: _Reader) -> torch.Tensor:
    """The box (``offset``, ``shape``) of saved tensor ``key``, from every chunk that overlaps."""
    out = torch.empty(shape, dtype=_dtype(entry["dtype"]))
    covered = 0
    for chunk in entry["chunks"]:
        ov = _overlap(offset, shape, chunk["offset"], chunk["shape"])
        if ov is None:
            continue
        lo, hi = ov
        src = tuple(slice(low - c, h - c) for low, h, c in zip(lo, hi, chunk["offset"],
                                                                strict=True))
        dst = tuple(slice(low - o, h - o) for low, h, o in zip(lo, hi, offset, strict=True))
        out[dst] = reader.read(chunk["file"], chunk["key"], src)
        n = 1
        for low, h in zip(lo, hi, strict=True):
            n *= h - low
        covered += n
    want = 1
    for s in shape:
        want *= s
    if covered != want:
        raise ValueError(f"load: the saved chunks of {key!r} cover {covered} of the {want} "
                         f"elements of box offset={offset} shape={shape}; the checkpoint is "
                         "incomplete")
    return out


def load(model: nn.Module, path: str | os.PathLike, *,
         optimizer: torch.optim.Optimizer | None = None, strict: bool = True) -> list[str]:
    """Load checkpoint folder ``path`` into ``model``, resharding to its current layout.

    Each rank reads only the saved chunks overlapping what it holds. With ``strict``, a model
    tensor missing from the checkpoint or with another global shape raises. With ``optimizer``
    (built over the model's current parameters), its state is restored and resharded the same
    way. Returns the keys of the model that were not found (empty when ``strict``). Collective
    (ends with a barrier).
    """
    path = os.fspath(path)
    index = read_index(path)
    saved = index["tensors"]
    reader = _Reader(path, index["file_format"])
    state = model.state_dict()
    missing = []
    with torch.no_grad():
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                continue
            entry = saved.get(key)
            if entry is None:
                missing.append(key)
                continue
            if list(value.shape) != entry["shape"]:
                raise ValueError(f"load: {key!r} has global shape {list(value.shape)} in the "
                                 f"model but {entry['shape']} in {path}")
            if _is_dtensor(value):
                local_shape, offset = value._spec.local_shape_and_offset()
                target = value.to_local()
            else:
                local_shape, offset, target = tuple(value.shape), (0,) * value.ndim, value
            box = _assemble(entry, key, list(offset), list(local_shape), reader)
            target.copy_(box)
            # A Partial layout holds one term of a sum: put the value on the first rank only.
            if _is_dtensor(value) and any(p.is_partial() for p in value.placements):
                mesh = value.device_mesh
                if any(p.is_partial() and mesh.get_local_rank(m) != 0
                       for m, p in enumerate(value.placements)):
                    target.zero_()
    if missing and strict:
        shown = ", ".join(repr(k) for k in missing[:5])
        raise KeyError(f"load: {len(missing)} tensor(s) of the model are not in {path}: {shown}"
                       + (" ..." if len(missing) > 5 else "")
                       + f"; the checkpoint holds {len(saved)} tensors, e.g. "
                       + ", ".join(repr(k) for k in list(saved)[:3]))
    if optimizer is not None:
        _load_optimizer(model, optimizer, index, reader, path)
    get_platform().barrier()
    return missing


def full_state_dict(model: nn.Module | dict[str, Any], *, rank0_only: bool = True
                    ) -> dict[str, torch.Tensor]:
    """Plain, unsharded host tensors of ``model``'s state dict, gathered on rank 0.

    Works for any layout (TP shards, DP replicas, pipeline stages holding different layers):
    each distinct box is sent to rank 0 once. Other ranks get ``{}`` (or, with
    ``rank0_only=False``, the same dict, broadcast). Collective.
    """
    platform = get_platform()
    rank, world = platform.rank(), platform.world_size()
    state = model.state_dict() if isinstance(model, nn.Module) else model
    pieces = _pieces(state)
    mine, metas = _owned(pieces)
    owner: dict[tuple, int] = {}
    for r, items in enumerate(metas):
        for m in items:
            owner.setdefault((m["key"], tuple(m["offset"]), tuple(m["local_shape"])), r)
    out: dict[str, torch.Tensor] = {}
    if rank == 0:
        device = pieces[0].local.device if pieces else platform.device()
        order: list[str] = []
        for r, items in enumerate(metas):
            for m in items:
                key = m["key"]
                if key not in out:
                    out[key] = torch.empty(m["shape"], dtype=_dtype(m["dtype"]))
                    order.append(key)
                box = (key, tuple(m["offset"]), tuple(m["local_shape"]))
                if owner[box] != r or 0 in m["local_shape"]:
                    continue
                if r == 0:
                    local = next(p.local for p in mine if p.box() == box)
                else:
                    local = torch.empty(m["local_shape"], dtype=_dtype(m["dtype"]),
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
