"""``save``: every rank writes the boxes it is first to hold into a file no earlier save used;
after all ranks have written, rank 0 commits the new ``index.json`` in one atomic step and
removes what the previous save left. A rank that dies before the commit leaves the previous
checkpoint exactly as it was.
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from typing import Any

import torch
from torch import nn

from hyperpar.platform import get_platform

from . import _async
from ._boxes import Piece, host, owned, pieces
from ._commit import agree_or_raise, commit, take_lock
from ._format import FORMAT, INDEX_FILE, digest, shard_name
from ._lock import release
from .optim import merge_extras, optimizer_state

__all__ = ["async_save", "save"]


def save(model: nn.Module | dict[str, Any], path: str | os.PathLike, *,
         optimizer: torch.optim.Optimizer | None = None, file_format: str = "auto",
         force: bool = False) -> str:
    """Write ``model``'s state dict (or a state dict) as a sharded checkpoint folder ``path``.

    Collective. Each rank writes one new file with the boxes it is the first to hold; once
    every rank has written, rank 0 replaces ``index.json`` atomically, which is the moment the
    new checkpoint replaces the previous one in ``path``; then the previous save's files are
    removed. A crash before that moment leaves the previous checkpoint loadable. The index
    records each file's size and each chunk's sha256, which ``load`` checks.

    With ``optimizer``, its per-parameter state is saved too, laid out like the parameter
    (entries ``optimizer.<param name>.<state key>``), so it reshards on load like the model;
    its hyperparameters and non-tensor state go into the index. ``file_format``:
    ``"safetensors"``, ``"torch"`` (``torch.save``) or ``"auto"`` (safetensors when installed).
    Returns the index path.

    One save at a time per folder: rank 0 holds the lock file ``.hyperpar-save.lock`` for the
    whole save, and a second job saving into the same folder raises
    :class:`~hyperpar.checkpoint.ConcurrentSaveError` (on every rank, before writing anything).
    A lock left by a crashed job is taken over when its pid is dead on this host;
    ``force=True`` takes it over regardless (only once that job is known to be gone).
    """
    file_format = _resolve_format(file_format)
    if optimizer is not None and not isinstance(model, nn.Module):
        raise TypeError("save(optimizer=...) needs the model itself, not a state dict")
    state, extras = _state_to_save(model, optimizer)
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    lock, save_id = take_lock(path, force)
    try:
        return _save_locked(state, extras, optimizer is not None, path, file_format, save_id)
    finally:
        if lock is not None:
            release(lock, save_id)


def _save_locked(state: dict[str, Any], extras: dict[str, Any], with_optimizer: bool,
                 path: str, file_format: str, save_id: str) -> str:
    """Steps 1-4 of :func:`save`, under the folder's lock."""
    platform = get_platform()
    rank, world = platform.rank(), platform.world_size()
    # 1. Who writes which box (and every rank's optimizer extras), in one collective.
    mine, metas, proposals = owned(pieces(state), extras)
    # 2. Write this rank's file under a new name (errors are shared, not raised alone).
    written = _write_shard(path, shard_name(rank, world, save_id, file_format), mine,
                           file_format)
    # 3-4. Nobody commits before every rank has written; rank 0 commits, then cleans up.
    def add_optimizer(index: dict[str, Any]) -> None:
        index["optimizer"] = merge_extras(proposals)

    commit(path, written, metas, file_format, save_id,
           add_optimizer if with_optimizer else None)
    return os.path.join(path, INDEX_FILE)


def async_save(model: nn.Module | dict[str, Any], path: str | os.PathLike, *,
               optimizer: torch.optim.Optimizer | None = None, file_format: str = "auto",
               force: bool = False, timeout_s: float | None = None) -> Future[str]:
    """:func:`save`, with the writing and the commit in a background thread.

    Collective. Before it returns, every rank has taken part in the save's collectives (the
    lock, who writes which box, the optimizer's extras) and copied the tensors it writes to
    host memory, so the training step may change the parameters right away. A background
    thread then writes the shard and commits through the folder (see
    :mod:`hyperpar.checkpoint._async`: no collective outside the calling thread). Returns a
    :class:`concurrent.futures.Future` whose ``result()`` is the index path once the new
    checkpoint is committed, or raises :class:`~hyperpar.checkpoint.CheckpointError` on every
    rank; until then the folder holds the previous checkpoint, and a crash keeps it.

    A second save (``save`` or ``async_save``, any folder) started before this one is committed
    **waits** for it (each rank for its own thread) and then proceeds. ``timeout_s`` bounds how
    long rank 0 waits for the other ranks' shards, and they for its commit (default
    ``HYPERPAR_TIMEOUT``, 300 s): a rank that died makes the save fail, not hang.
    """
    from hyperpar.platform.timeout import default_timeout_s

    file_format = _resolve_format(file_format)
    if optimizer is not None and not isinstance(model, nn.Module):
        raise TypeError("async_save(optimizer=...) needs the model itself, not a state dict")
    state, extras = _state_to_save(model, optimizer)
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    lock, save_id = take_lock(path, force)
    try:
        platform = get_platform()
        rank, world = platform.rank(), platform.world_size()
        mine, metas, proposals = owned(pieces(state), extras)
        error, staged = None, {}
        try:  # copies, not views: the step may overwrite the parameters as soon as we return
            staged = dict(zip(_keys(mine), stage(p.local for p in mine), strict=True))
        except Exception as exc:
            error = exc
        agree_or_raise(error)
    except BaseException:
        if lock is not None:
            release(lock, save_id)
        raise
    name = shard_name(rank, world, save_id, file_format)

    def add_optimizer(index: dict[str, Any]) -> None:
        index["optimizer"] = merge_extras(proposals)

    return _async.start(path, save_id, lock, rank, world, metas, file_format,
                        lambda: _write_tensors(path, name, staged, file_format),
                        add_optimizer if optimizer is not None else None,
                        default_timeout_s() if timeout_s is None else timeout_s)


def stage(tensors: Any) -> list[torch.Tensor]:
    """Contiguous host copies that share storage with nothing (``host`` may return the
    tensor itself when it is already on the host)."""
    return [h.clone() if h.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
            else h for t, h in ((t, t.detach().cpu().contiguous()) for t in tensors)]


def _keys(mine: list[Piece]) -> list[str]:
    return [f"{p.key}@{','.join(map(str, p.offset))}" for p in mine]


def _resolve_format(file_format: str) -> str:
    has_st = _has_safetensors()
    if file_format == "auto":
        return "safetensors" if has_st else "torch"
    if file_format not in ("safetensors", "torch"):
        raise ValueError(f"save: file_format must be 'auto', 'safetensors' or 'torch', got "
                         f"{file_format!r}")
    if file_format == "safetensors" and not has_st:
        raise ImportError("save(file_format='safetensors') needs `pip install safetensors`")
    return file_format


def _has_safetensors() -> bool:
    try:
        import safetensors.torch  # noqa: F401
    except ImportError:
        return False
    return True


def _state_to_save(model: nn.Module | dict[str, Any], optimizer: torch.optim.Optimizer | None
                   ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The tensors to save (model, then optimizer state) and the optimizer's non-tensor state
    (hyperparameters, scalars, class, state keys)."""
    state = model.state_dict() if isinstance(model, nn.Module) else dict(model)
    if optimizer is None:
        return state, {}
    assert isinstance(model, nn.Module)
    opt_tensors, extras = optimizer_state(model, optimizer)
    return {**state, **opt_tensors}, extras


def _write_shard(path: str, name: str, mine: list[Piece], file_format: str) -> dict[str, Any]:
    """Write ``mine`` to a new file ``name``, durably; its size and per-chunk digests, or the
    error."""
    try:
        tensors = dict(zip(_keys(mine), host(p.local for p in mine), strict=True))
    except Exception as exc:
        return {"file": name, "error": f"{os.path.join(path, name)}: {type(exc).__name__}: {exc}"}
    return _write_tensors(path, name, tensors, file_format)


def _write_tensors(path: str, name: str, tensors: dict[str, torch.Tensor], file_format: str
                   ) -> dict[str, Any]:
    """Write host ``tensors`` to a new file ``name``, durably; its size and per-chunk
    digests, or the error."""
    full = os.path.join(path, name)
    try:
        digests = {k: digest(t) for k, t in tensors.items()}
        _write_file(full, tensors, file_format)
        with open(full, "rb") as f:
            os.fsync(f.fileno())
        return {"file": name, "bytes": os.path.getsize(full), "digests": digests}
    except Exception as exc:
        return {"file": name, "error": f"{full}: {type(exc).__name__}: {exc}"}


def _write_file(full: str, tensors: dict[str, torch.Tensor], file_format: str) -> None:
    if file_format == "safetensors":
        import safetensors.torch as st

        st.save_file(tensors, full, metadata={"format": FORMAT})
    else:
        torch.save(tensors, full)
