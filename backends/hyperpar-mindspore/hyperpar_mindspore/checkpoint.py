"""hyperpar checkpoints of MindSpore Cells: the same folder format as PyTorch models
(``hyperpar.checkpoint``: safetensors shards, an atomically committed ``index.json``, sha256
per chunk, resharded on load), written and read through :mod:`hyperpar.checkpoint.arrays`.

>>> checkpoint.save(cell, "ckpt/step-100")                  # doctest: +SKIP
>>> checkpoint.load(cell, "ckpt/step-100")                  # any tp layout, or one process
>>> checkpoint.load(cell, "ckpt/torch-run", name_map=torch_name_map(cell))   # torch's names

``hyperpar.checkpoint.save`` / ``load`` call these for a Cell. A tensor-parallel shard (a
``Parameter`` ``parallelize_module`` split) and a ``fully_shard`` shard (its unpadded dim-0
rows, as torch's FSDP2 holds them) are saved as their boxes of the global tensor, so a folder
saved on 2 tp ranks loads as fsdp2 or in one process, and the reverse. Keys are the Cell's
parameter paths (``parameters_and_names()``), or what ``name_map`` makes of them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any, NamedTuple

import mindspore as ms
import numpy as np
from mindspore import nn

from hyperpar.checkpoint._commit import agree_or_raise
from hyperpar.checkpoint._format import CheckpointError, LoadResult, read_index
from hyperpar.checkpoint.arrays import (
    ArrayBox,
    Want,
    async_save_arrays,
    load_arrays,
    save_arrays,
)
from hyperpar.checkpoint.optim_map import is_torch
from hyperpar.dtensor.placement import Replicate, Shard
from hyperpar.platform import get_platform

from . import optim_cross
from .fsdp_sections import units_of
from .parallel import SHARD_GROUP
from .tensors import SHARD_PLACEMENTS

__all__ = ["load", "save", "torch_name_map"]

NameMap = Mapping[str, str] | Callable[[str], str] | None


def torch_name_map(model: nn.Cell) -> dict[str, str]:
    """MindSpore parameter path -> PyTorch's name of the same tensor, for the layers whose
    names differ: ``LayerNorm`` ``gamma``/``beta`` -> ``weight``/``bias``, ``Embedding``
    ``embedding_table`` -> ``weight``, ``BatchNorm`` ``gamma``/``beta``/``moving_mean``/
    ``moving_variance`` -> ``weight``/``bias``/``running_mean``/``running_var``. ``Dense``
    weights are ``(out, in)`` in both, so their names and values match as they are."""
    renames = {nn.LayerNorm: {"gamma": "weight", "beta": "bias"},
               nn.Embedding: {"embedding_table": "weight"}}
    bn = {"gamma": "weight", "beta": "bias", "moving_mean": "running_mean",
          "moving_variance": "running_var"}
    out: dict[str, str] = {}
    for path, cell in model.cells_and_names():
        table = next((t for cls, t in renames.items() if isinstance(cell, cls)), None)
        if table is None and type(cell).__name__.startswith("BatchNorm"):
            table = bn
        for attr, torch_name in (table or {}).items():
            if cell._params.get(attr) is not None:
                prefix = f"{path}." if path else ""
                out[prefix + attr] = prefix + torch_name
    return out


def _key(name: str, name_map: NameMap) -> str:
    if name_map is None:
        return name
    if callable(name_map):
        return name_map(name)
    return name_map.get(name, name)


def _layout(model: nn.Cell, name_map: NameMap) -> dict[str, tuple[Any, ArrayBox | Want]]:
    """key -> (parameter, its box): where this rank's piece of each parameter sits in the
    global tensor. One collective (every rank's tensor-parallel shard lengths)."""
    if not isinstance(model, nn.Cell):
        raise TypeError(f"checkpoint: expected a mindspore.nn.Cell, got {type(model).__name__}")
    fsdp = _fsdp_pieces(model)
    platform = get_platform()
    params = list(model.parameters_and_names())
    keys: dict[str, str] = {}
    for name, _p in params:
        key = _key(name, name_map)
        if key in keys:
            raise ValueError(f"checkpoint: name_map sends both {keys[key]!r} and {name!r} to "
                             f"{key!r}; give every parameter its own checkpoint name")
        keys[key] = name
    # key -> (dim, this rank's tp-local length along it, the tp group's ranks): a parameter
    # parallelize_module split, as it is or under fully_shard's rows (dp x tp)
    sharded = {}
    for name, p in params:
        placements = getattr(p, SHARD_PLACEMENTS, None)
        group = getattr(p, SHARD_GROUP, None)
        piece = fsdp.get(id(p))
        if piece is None and group is None and any(isinstance(q, Shard)
                                                   for q in placements or ()):
            # an expert style's piece (no tp group recorded): saved as it is, every rank's
            # piece would claim to be the whole tensor. Same parameters on every rank, so
            # every rank raises here, before the collective below.
            raise CheckpointError(
                f"checkpoint: {name!r} is this rank's piece of an expert-parallel split "
                f"{tuple(placements)}; checkpoints of expert-parallel Cells on MindSpore are "
                f"not supported yet: save {{name: p.full_tensor()}} yourself, or see "
                f"docs/mindspore.md, 'Expert parallelism on Cells'")
        if piece is not None:
            if piece.tp is not None:
                d, group = piece.tp
                sharded[_key(name, name_map)] = (d, piece.shape[d], tuple(group.ranks))
        elif placements and isinstance(placements[0], Shard) and group is not None and (
                platform.world_size(group) > 1):
            d = placements[0].dim % len(p.shape)
            sharded[_key(name, name_map)] = (d, int(p.shape[d]), tuple(group.ranks))
    everyone = platform.all_gather_object(sharded)
    me = platform.rank()
    out: dict[str, tuple[Any, Any]] = {}
    for name, p in params:
        key = _key(name, name_map)
        piece = fsdp.get(id(p))
        local = piece.shape if piece is not None else tuple(int(s) for s in p.shape)
        shape, offset = list(local), [0] * len(local)
        placements: list[str] = []
        mesh_shape: list[int] = []
        if key in sharded:   # the tp piece's box in the global tensor
            d, _, ranks = sharded[key]
            lengths = [everyone[r][key][1] for r in ranks]
            shape[d] = sum(lengths)
            offset[d] = sum(lengths[:ranks.index(me)])
            placements, mesh_shape = [repr(Shard(d))], [len(ranks)]
        if piece is None:
            out[key] = (p, ArrayBox(tuple(shape), tuple(offset), p.asnumpy(), placements,
                                    mesh_shape))
            continue
        # fully_shard's rows of that (tp) piece: dim 0 moves by the first row held. Recorded
        # tp first: by distribute_tensor's rule (mesh dim 0 splits first) that reads "the tp
        # split, then dp rows within each piece", the layout held
        offset[0] += piece.start
        out[key] = (p, ArrayBox(tuple(shape), tuple(offset), piece.array,
                                placements + piece.placements, mesh_shape + piece.mesh_shape))
    return out


class _FsdpPiece(NamedTuple):
    """This rank's rows of a fully_shard unit's parameter: ``array`` (unpadded) starts at row
    ``start`` of the tensor the unit sharded, whose shape is ``shape`` -- the global tensor, or
    a tensor-parallel piece of it when ``tp`` = ``(dim, group)`` (dp x tp)."""

    shape: tuple[int, ...]
    start: int
    array: np.ndarray
    placements: list[str]
    mesh_shape: list[int]
    tp: tuple[int, Any] | None


def _fsdp_pieces(model: nn.Cell) -> dict[int, _FsdpPiece]:
    """id of each fully_shard shard ``Parameter`` -> this rank's piece: the unpadded
    ``torch.chunk`` rows it holds (torch FSDP2's layout, so the index records what torch's
    records: ``Shard(dim=0)``, HSDP ``Replicate(), Shard(dim=0)``; under dp x tp the rows are
    taken within the tp piece, and :func:`_layout` puts the tp placement first)."""
    platform = get_platform()
    out: dict[int, _FsdpPiece] = {}
    for unit in (u for _name, cell in model.cells_and_names() for u in units_of(cell)):
        plan = unit.plan
        n, rep = plan.shard_size, plan.replicate
        me = platform.rank(unit.shard_group) if n > 1 else 0
        placements = ([repr(Replicate())] if rep > 1 else []) + [repr(Shard(0))]
        mesh_shape = ([rep] if rep > 1 else []) + [n]
        split = [slot.name for slot, s in zip(plan.slots, getattr(unit, "style_split", ()),
                                               strict=False) if s]
        if split:  # every rank holds the same layout: every rank raises, before any collective
            raise CheckpointError(
                f"checkpoint: {split[0]!r} is a fully_shard shard of a piece ExpertParallel "
                f"split; checkpoints of expert-parallel Cells on MindSpore are not supported "
                f"yet (docs/mindspore.md, 'Expert parallelism on Cells')")
        for shard, slot, tp in zip(unit.shards, plan.slots, unit.tp_layouts, strict=True):
            start, length = slot.starts[me], slot.lengths[me]
            array = shard.asnumpy()[:length]  # the padding rows are not part of the tensor
            out[id(shard)] = _FsdpPiece(tuple(slot.shape), start, array, placements,
                                        mesh_shape, tp)
    return out


def _set_shard(param: Any, box: ArrayBox, arr: np.ndarray) -> None:
    """Put ``arr`` (this rank's unpadded rows) into a fully_shard shard Parameter, the
    padding rows zero (they must stay zero: the gathered tensor drops them)."""
    if arr.shape != box.array.shape:
        raise CheckpointError(f"load: {param.name!r}: read {arr.shape}, this rank's fully_shard "
                              f"rows are {box.array.shape}")
    piece = np.zeros(tuple(param.shape), dtype=ms.dtype_to_nptype(param.dtype))
    piece[:arr.shape[0]] = arr
    param.set_data(ms.Tensor(piece))


def _check_optimizer_type(optimizer: Any) -> None:
    """Refuse a non-optimizer up front, before any collective (every rank is given one)."""
    if optimizer is not None and not isinstance(optimizer, nn.Optimizer):
        raise TypeError(f"checkpoint: optimizer= must be a mindspore.nn.Optimizer built over "
                        f"the Cell's parameters, got {type(optimizer).__name__}")


def _optimizer_layout(optimizer: Any, layout: dict[str, tuple[Any, Any]]
                      ) -> dict[str, tuple[Any, ArrayBox]]:
    """key -> (state Parameter, its box) for ``optimizer``'s own Parameters. A per-parameter
    state (MindSpore names it ``<state>.<parameter name>``: Adam's ``moment1``/``moment2``,
    SGD's ``accum``/``stat``, Momentum's ``moments``, AdamWeightDecay's ``adam_m``/``adam_v``)
    is laid out as its parameter -- the same box of the global tensor, so it reshards like it
    -- under ``optimizer.<parameter key>.<state>``; the optimizer's scalars (``global_step``,
    ``beta1_power``, ``learning_rate``...) are replicated, under ``optimizer.<name>``."""
    by_name = {p.name: (key, p, box) for key, (p, box) in layout.items()}
    model_ids = {id(p) for p, _box in layout.values()}
    out: dict[str, tuple[Any, ArrayBox]] = {}
    for _attr, state in optimizer.parameters_and_names():
        if id(state) in model_ids:
            continue
        prefix, _, rest = state.name.partition(".")
        owner = by_name.get(rest) if rest else None
        if owner is not None and tuple(state.shape) == tuple(owner[1].shape):
            key, param, box = owner
            rows = box.array.shape[0] if box.array.ndim else None
            array = state.asnumpy()
            if rows is not None and array.shape != box.array.shape:   # fully_shard padding
                array = array[:rows]
            out[f"optimizer.{key}.{prefix}"] = (state, ArrayBox(
                box.shape, box.offset, array, box.placements, box.mesh_shape))
            continue
        if owner is None and rest and rest in {p.name for p, _b in layout.values()}:
            raise CheckpointError(f"checkpoint: optimizer state {state.name!r} does not have "
                                  f"its parameter's shape")
        # a 0-d scalar (learning_rate, beta1_power) is stored as one element: the numpy
        # checkpoint path keeps at least one dim, and load gives the Parameter its own shape
        local = tuple(int(d) for d in state.shape) or (1,)
        array = np.ascontiguousarray(state.asnumpy().reshape(local))
        out[f"optimizer.{state.name}"] = (state, ArrayBox(local, (0,) * len(local), array, [],
                                                          []))
    return out


def save(model: nn.Cell, path: str | os.PathLike, *, name_map: NameMap = None,
         optimizer: Any = None, file_format: str = "auto", force: bool = False) -> str:
    """Save ``model``'s parameters as a hyperpar checkpoint folder ``path`` (collective; every
    rank calls it). ``name_map``: parameter path -> checkpoint key (a dict, missing names kept,
    or a function), e.g. :func:`torch_name_map` for a folder a PyTorch model loads.
    ``optimizer``: a ``mindspore.nn.Optimizer`` over the model's parameters whose state is
    saved with them, each per-parameter tensor sharded as its parameter (see
    :func:`_optimizer_layout`). Returns the index path."""
    state, extend = _to_save(model, name_map, optimizer, file_format)
    return save_arrays(state, path, force=force, extend_index=extend)


def async_save(model: nn.Cell, path: str | os.PathLike, *, name_map: NameMap = None,
               optimizer: Any = None, file_format: str = "auto", force: bool = False,
               timeout_s: float | None = None) -> Future[str]:
    """:func:`save` returning a future once every array is copied to host memory; the write
    and the atomic commit run in a background thread (the shared numpy path,
    :func:`hyperpar.checkpoint.arrays.async_save_arrays`). Collective."""
    state, extend = _to_save(model, name_map, optimizer, file_format)
    return async_save_arrays(state, path, force=force, extend_index=extend,
                             timeout_s=timeout_s)


def _to_save(model: nn.Cell, name_map: NameMap, optimizer: Any, file_format: str
             ) -> tuple[dict[str, ArrayBox], Callable[[dict[str, Any]], None] | None]:
    """This rank's boxes to save and the optimizer's section of the index (or None)."""
    if file_format not in ("auto", "safetensors"):
        raise ValueError(f"checkpoint.save: a MindSpore Cell is saved as safetensors; got "
                         f"file_format={file_format!r} (use 'auto' or 'safetensors')")
    _check_optimizer_type(optimizer)
    layout = _layout(model, name_map)
    boxes = {key: box for key, (_p, box) in layout.items()}
    if optimizer is not None:
        boxes.update((key, box) for key, (_s, box) in
                     _optimizer_layout(optimizer, layout).items())
    # a rank holding no rows of a tensor (fully_shard of fewer rows than ranks) writes nothing
    state = {key: box for key, box in boxes.items() if box.array.size or not box.array.ndim}
    if optimizer is None:
        return state, None
    cls = _class_name(optimizer)
    hyper = optim_cross.hyperparameters(optimizer)   # a torch load checks them

    def extend(index: dict[str, Any]) -> None:
        keys = sorted(k for k in index["tensors"] if k.startswith("optimizer."))
        index["optimizer"] = {"class": cls, "param_groups": [{}], "scalars": {},
                              "tensors": keys, "hyperparameters": hyper}

    return state, extend


def _class_name(optimizer: Any) -> str:
    cls = type(optimizer)
    return f"{cls.__module__}.{cls.__qualname__}"


def _check_optimizer_section(optimizer: Any, opt_layout: dict[str, tuple[Any, Any]],
                             path: str | os.PathLike) -> optim_cross.Translation | None:
    """Refuse (on every rank, before reading any tensor) a checkpoint without optimizer
    state or with another optimizer's; a torch optimizer's state is accepted when the two
    are a pair of ``hyperpar.checkpoint.optim_map`` (the same update), and the translation
    is returned (else None: the same class)."""
    error: Exception | None = None
    translation = None
    try:
        index = read_index(os.fspath(path))
        section = index.get("optimizer")
        mine = _class_name(optimizer)
        if section is None:
            raise CheckpointError(f"load(optimizer=...): {os.fspath(path)} holds no optimizer "
                                  f"state (save it with save(model, path, optimizer=opt))")
        if section.get("class") != mine and is_torch(section.get("class")):
            pair = optim_cross.check_translated(optimizer, section, mine, os.fspath(path))
            translation = optim_cross.Translation(pair, optimizer, opt_layout, index,
                                                  os.fspath(path))
        elif section.get("class") != mine:
            raise CheckpointError(
                f"load(optimizer=...): {os.fspath(path)} holds the state of a "
                f"{section.get('class')} but the optimizer given is a {mine}; build the "
                f"optimizer type that saved it, or load without optimizer= and start its state "
                f"afresh")
    except Exception as exc:   # shared: no rank reads tensors the others refused
        error = exc
    agree_or_raise(error)
    return translation


def load(model: nn.Cell, path: str | os.PathLike, *, name_map: NameMap = None,
         optimizer: Any = None, strict: bool = True, verify: bool = True) -> LoadResult:
    """Load checkpoint folder ``path`` (saved by either framework, in any layout) into
    ``model``'s current layout: each rank reads its box of every parameter. ``strict`` and the
    result are ``hyperpar.checkpoint.load``'s; values are cast to each parameter's dtype.
    ``optimizer``: restore the state :func:`save` wrote for an optimizer of the same class
    (build it over the model's parameters first), resharded like the parameters -- or a torch
    optimizer's state, translated, when the two are a pair of
    ``hyperpar.checkpoint.optim_map`` (torch Adam -> ``nn.Adam``, SGD -> ``nn.Momentum`` /
    ``nn.SGD``); the hyperparameters stay ``optimizer``'s."""
    _check_optimizer_type(optimizer)
    layout = _layout(model, name_map)
    targets: dict[str, tuple[Any, Any]] = dict(layout)
    translation = None
    if optimizer is not None:
        opt_layout = _optimizer_layout(optimizer, layout)
        translation = _check_optimizer_section(optimizer, opt_layout, path)
        # a torch optimizer's state: its entries, read into the MindSpore state's boxes
        targets.update(opt_layout if translation is None else translation.targets)
    wanted = {key: Want(box.shape, box.offset, tuple(box.array.shape))
              for key, (_p, box) in targets.items()}
    if translation is not None:
        wanted.update(translation.steps)
    arrays, result = load_arrays(wanted, path, strict=strict, verify=verify)
    if translation is not None:
        steps = {key: arrays.pop(key) for key in translation.steps if key in arrays}
    for key, arr in arrays.items():
        param, box = targets[key]
        want = ms.dtype_to_nptype(param.dtype)
        if not param.shape and arr.shape == (1,):   # an optimizer scalar (see above)
            arr = arr.reshape(())
        elif box.array.shape != tuple(param.shape):  # a fully_shard shard: padded rows
            _set_shard(param, box, arr.astype(want, copy=False))
            continue
        if arr.shape != tuple(param.shape):
            raise CheckpointError(f"load: {key!r}: read {arr.shape}, parameter holds "
                                  f"{tuple(param.shape)}")
        param.set_data(ms.Tensor(np.ascontiguousarray(arr.astype(want, copy=False))))
    if translation is not None:
        translation.apply(steps)
    return result
