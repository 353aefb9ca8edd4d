"""Save and load a checkpoint folder from numpy arrays: hyperpar's format (safetensors shards,
``index.json`` committed atomically, sha256 per chunk, boxes resharded on load) with no deep
learning framework. The MindSpore backend (``hyperpar_mindspore.checkpoint``) turns a Cell's
parameters into :class:`ArrayBox` es and back; the lock, the index and the commit are the same
steps the PyTorch writer runs (:mod:`._commit`), so either framework reads the other's folders.

Needs ``numpy`` and ``safetensors`` (its numpy API); imports neither torch nor MindSpore.
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hyperpar.platform import get_platform

from . import _async
from ._commit import (
    agree_or_raise,
    check_keys,
    commit,
    owners,
    regions,
    take_lock,
)
from ._format import (
    FORMAT,
    INDEX_FILE,
    CheckpointError,
    CorruptCheckpointError,
    LoadResult,
    digest_array,
    dtype_name,
    read_index,
    shard_name,
)
from ._lock import release
from ._replicas import check_replicas_agree
from ._validate import check_files, confined_file

__all__ = ["ArrayBox", "async_save_arrays", "load_arrays", "save_arrays"]

OPTIM_PREFIX = "optimizer."


@dataclass
class ArrayBox:
    """This rank's box of one tensor: ``array`` sits at ``offset`` in the global ``shape``.
    ``placements`` / ``mesh_shape`` are recorded in the index (``repr`` of each placement and
    the mesh's shape; empty for a plain tensor)."""

    shape: tuple[int, ...]
    offset: tuple[int, ...]
    array: np.ndarray
    placements: list[str] = field(default_factory=list)
    mesh_shape: list[int] = field(default_factory=list)

    def box(self, key: str) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
        return key, tuple(self.offset), tuple(self.array.shape)

    def meta(self, key: str) -> dict[str, Any]:
        return {"key": key, "shape": list(self.shape), "dtype": dtype_name(self.array.dtype),
                "offset": list(self.offset), "local_shape": list(self.array.shape),
                "placements": self.placements, "mesh_shape": self.mesh_shape}


def _check_dtypes(state: dict[str, ArrayBox]) -> None:
    for key, box in state.items():
        if box.array.dtype.kind not in "biuf" or box.array.dtype.itemsize > 8:
            raise CheckpointError(f"save: {key!r} has dtype {box.array.dtype}, which the "
                                  "numpy checkpoint path does not store; cast it to float32")


def save_arrays(state: dict[str, ArrayBox], path: str | os.PathLike, *,
                force: bool = False, extend_index: Any = None) -> str:
    """Write ``state`` (this rank's boxes) as checkpoint folder ``path``; returns the index
    path. Collective; the same steps and guarantees as :func:`hyperpar.checkpoint.save`.
    ``extend_index(index)`` may add sections to the index before rank 0 commits it."""
    _check_dtypes(state)
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    lock, save_id = take_lock(path, force)
    try:
        return _save_locked(state, path, save_id, extend_index)
    finally:
        if lock is not None:
            release(lock, save_id)


def async_save_arrays(state: dict[str, ArrayBox], path: str | os.PathLike, *,
                      force: bool = False, extend_index: Any = None,
                      timeout_s: float | None = None) -> Future[str]:
    """:func:`save_arrays` with the write and the commit in a background thread, as
    :func:`hyperpar.checkpoint.writer.async_save`: the collectives run and the arrays this rank
    writes are copied before it returns; the future gives the index path once committed.
    Collective."""
    from hyperpar.platform.timeout import default_timeout_s

    _check_dtypes(state)
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    lock, save_id = take_lock(path, force)
    try:
        mine, metas = _mine(state)
        # copies: a framework's host array may share memory with the live parameter
        staged = {f"{key}@{','.join(map(str, box.offset))}": np.array(box.array, order="C",
                                                                        copy=True)
                  for key, box in mine.items()}
    except BaseException:
        if lock is not None:
            release(lock, save_id)
        raise
    platform = get_platform()
    rank, world = platform.rank(), platform.world_size()
    name = shard_name(rank, world, save_id, "safetensors")
    return _async.start(path, save_id, lock, rank, world, metas, "safetensors",
                        lambda: _write_staged(path, name, staged), extend_index,
                        default_timeout_s() if timeout_s is None else timeout_s)


def _mine(state: dict[str, ArrayBox]) -> tuple[dict[str, ArrayBox], list[list[dict[str, Any]]]]:
    """The boxes this rank writes and every rank's box metadata (collective)."""
    platform = get_platform()
    metas = platform.all_gather_object([box.meta(key) for key, box in state.items()])
    check_replicas_agree(metas, {box.box(key): (lambda b=box: np.ascontiguousarray(b.array))
                                 for key, box in state.items()})
    owner = owners(metas)
    rank = platform.rank()
    return {key: box for key, box in state.items() if owner[box.box(key)] == rank}, metas


def _save_locked(state: dict[str, ArrayBox], path: str, save_id: str,
                 extend_index: Any = None) -> str:
    platform = get_platform()
    rank, world = platform.rank(), platform.world_size()
    mine, metas = _mine(state)
    written = _write_shard(path, shard_name(rank, world, save_id, "safetensors"), mine)
    commit(path, written, metas, "safetensors", save_id, extend_index)
    return os.path.join(path, INDEX_FILE)


def _write_shard(path: str, name: str, mine: dict[str, ArrayBox]) -> dict[str, Any]:
    try:
        tensors = {f"{key}@{','.join(map(str, box.offset))}": np.ascontiguousarray(box.array)
                   for key, box in mine.items()}
    except Exception as exc:
        return {"file": name, "error": f"{os.path.join(path, name)}: {type(exc).__name__}: {exc}"}
    return _write_staged(path, name, tensors)


def _write_staged(path: str, name: str, tensors: dict[str, np.ndarray]) -> dict[str, Any]:
    full = os.path.join(path, name)
    try:
        from safetensors.numpy import save_file

        digests = {k: digest_array(a) for k, a in tensors.items()}
        save_file(tensors, full, metadata={"format": FORMAT})
        with open(full, "rb") as f:
            os.fsync(f.fileno())
        return {"file": name, "bytes": os.path.getsize(full), "digests": digests}
    except Exception as exc:
        return {"file": name, "error": f"{full}: {type(exc).__name__}: {exc}"}


# --------------------------------------------------------------------------------- load
@dataclass
class Want:
    """The box of one tensor this rank holds now: global ``shape``, ``offset``, ``local``
    shape."""

    shape: tuple[int, ...]
    offset: tuple[int, ...]
    local: tuple[int, ...]


def load_arrays(wanted: dict[str, Want], path: str | os.PathLike, *, strict: bool = True,
                verify: bool = True) -> tuple[dict[str, np.ndarray], LoadResult]:
    """Read this rank's box of every tensor in ``wanted`` from checkpoint folder ``path``
    (whatever layout it was saved in). Returns the arrays found and ``LoadResult(missing,
    unexpected)`` over all ranks. ``strict``: a missing or unexpected tensor raises
    :class:`CheckpointError` (on every rank). Collective."""
    path = os.fspath(path)
    platform = get_platform()
    error: Exception | None = None
    index: dict[str, Any] = {}
    try:
        index = read_index(path)
        if index["file_format"] != "safetensors":
            raise CheckpointError(f"load: {path} was saved with file_format="
                                  f"{index['file_format']!r}; without torch only safetensors "
                                  "checkpoints load: save with file_format='safetensors'")
        check_files(path, index, part=(platform.rank(), platform.world_size()))
    except Exception as exc:  # shared: a rank that failed alone must not leave others waiting
        error = exc
    agree_or_raise(error)
    result = _check_keys(wanted, index, path, strict)
    out: dict[str, np.ndarray] = {}
    try:
        reader = _Reader(path, index, verify)
        for key, want in wanted.items():
            entry = index["tensors"].get(key)
            if entry is not None:
                out[key] = reader.assemble(entry, key, list(want.offset), list(want.local))
    except Exception as exc:
        error = exc
    agree_or_raise(error)
    return out, result


NAME_MAP_HINT = (" (pass strict=False to load the matching tensors only, or name_map= to map "
                 "the model's names to the checkpoint's)")


def _check_keys(wanted: dict[str, Want], index: dict[str, Any], path: str,
                strict: bool) -> LoadResult:
    saved = index["tensors"]
    model_only = {k for k in saved if not ("optimizer" in index and k.startswith(OPTIM_PREFIX))}
    missing, unexpected = check_keys({k: w.shape for k, w in wanted.items()}, index, path,
                                     strict, model_only, hint=NAME_MAP_HINT)
    return LoadResult(missing, unexpected)


class _Reader:
    """Shard files opened lazily with safetensors' numpy API; each chunk is checked against
    its digest (``verify``) before use."""

    def __init__(self, path: str, index: dict[str, Any], verify: bool) -> None:
        self.path, self.verify = path, verify
        self._open: dict[str, Any] = {}

    def _handle(self, file: str) -> Any:
        if file not in self._open:
            from safetensors import safe_open

            full = confined_file(self.path, file, what=f"index.json of {self.path}")
            try:
                self._open[file] = safe_open(full, framework="numpy")
            except Exception as exc:
                raise CorruptCheckpointError(f"{full} cannot be opened as a safetensors file "
                                             f"({type(exc).__name__}: {exc})") from exc
        return self._open[file]

    def read(self, chunk: dict[str, Any], key: str) -> np.ndarray:
        full = os.path.join(self.path, chunk["file"])
        try:
            whole = self._handle(chunk["file"]).get_tensor(chunk["key"])
        except CorruptCheckpointError:
            raise
        except Exception as exc:
            raise CorruptCheckpointError(f"{full}: cannot read {chunk['key']!r} of {key!r} "
                                         f"({type(exc).__name__}: {exc})") from exc
        if list(whole.shape) != list(chunk["shape"]) or (
                self.verify and "digest" in chunk and digest_array(whole) != chunk["digest"]):
            raise CorruptCheckpointError(
                f"{full}: the bytes of {key!r} (chunk at offset {chunk['offset']}) do not match "
                "the sha256 digest in index.json: the file was modified after the save; restore "
                "it or save again")
        return whole

    def assemble(self, entry: dict[str, Any], key: str, offset: list[int],
                 shape: list[int]) -> np.ndarray:
        try:
            dtype = np.dtype(entry["dtype"])
        except TypeError:
            raise CheckpointError(f"load: {key!r} is stored as {entry['dtype']}, which numpy "
                                  "(the checkpoint path without torch) cannot hold") from None
        out = np.empty(shape, dtype=dtype)
        for chunk, src, dst in regions(entry, key, offset, shape):
            out[dst] = self.read(chunk, key)[src]
        return out
