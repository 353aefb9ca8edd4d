"""The framework-neutral steps of a save and a load: the folder lock and save id, who writes
which box, the index of a save, cleaning up, and sharing one rank's failure with all ranks.

The PyTorch :mod:`.writer` / :mod:`.loader` and the numpy path (:mod:`.arrays`, which the
MindSpore backend uses) both run these, so the two write the same folders. No framework here.
"""

from __future__ import annotations

import os
import secrets
import time
from typing import Any

from hyperpar.platform import get_platform

from ._format import (
    DIGEST,
    FORMAT,
    INDEX_FILE,
    VERSION,
    CheckpointError,
    CorruptCheckpointError,
    is_checkpoint_file,
)
from ._lock import ConcurrentSaveError, acquire

Box = tuple[str, tuple[int, ...], tuple[int, ...]]


def take_lock(path: str, force: bool) -> tuple[str | None, str]:
    """Rank 0 takes the folder's save lock (one save at a time); every rank learns the outcome
    and rank 0's fresh save id before anything is written. Returns ``(lock, save_id)`` (the
    lock file on rank 0, None elsewhere). Collective."""
    platform = get_platform()
    rank = platform.rank()
    lock, taken = None, None
    if rank == 0:
        save_id = new_save_id()
        try:
            lock = acquire(path, save_id, force=force)
            taken = ("ok", save_id)
        except (CheckpointError, OSError) as exc:
            taken = (type(exc).__name__, str(exc))
    status, detail = platform.broadcast_object(taken, 0)
    if status != "ok":
        cls = ConcurrentSaveError if status == ConcurrentSaveError.__name__ else CheckpointError
        where = "" if rank == 0 else "rank 0: "
        if cls is CheckpointError:
            detail = f"save: cannot create the lock file in {path}: {status}: {detail}"
        raise cls(where + detail)
    return lock, detail


def new_save_id() -> str:
    """Unique per save: a clock part (sortable) and a random part (two saves in one tick)."""
    return f"{time.time_ns() // 1_000_000:x}{secrets.token_hex(3)}"


def build_index(metas: list[list[dict[str, Any]]], files: list[dict[str, Any]],
                 file_format: str, world: int, save_id: str) -> dict[str, Any]:
    """The index of this save: every tensor's layout and where each distinct box lives."""
    entries: dict[str, Any] = {}
    written: set[tuple] = set()
    for r, items in enumerate(metas):
        for m in items:
            key = m["key"]
            entry = entries.setdefault(key, {
                "shape": m["shape"], "dtype": m["dtype"], "placements": m["placements"],
                "mesh_shape": m["mesh_shape"], "chunks": []})
            if entry["shape"] != m["shape"]:
                raise CheckpointError(f"save: {key!r} has global shape {m['shape']} on rank "
                                      f"{r} but {entry['shape']} on a lower rank")
            box = (key, tuple(m["offset"]), tuple(m["local_shape"]))
            if box in written:
                continue
            written.add(box)
            name = f"{key}@{','.join(map(str, m['offset']))}"
            entry["chunks"].append({
                "file": files[r]["file"], "key": name, "offset": m["offset"],
                "shape": m["local_shape"], "rank": r, "digest": files[r]["digests"][name]})
    return {"format": FORMAT, "version": VERSION, "file_format": file_format,
            "world_size": world, "save_id": save_id, "digest": DIGEST,
            "files": {f["file"]: {"rank": r, "bytes": f["bytes"]} for r, f in enumerate(files)},
            "tensors": entries}


def remove_stale(path: str, keep: set[str]) -> None:
    """Remove files of earlier (or crashed) saves: everything a save writes but ``keep``."""
    for name in os.listdir(path):
        if name not in keep and name != INDEX_FILE and is_checkpoint_file(name):
            try:
                os.remove(os.path.join(path, name))
            except FileNotFoundError:
                pass


def owners(metas: list[list[dict[str, Any]]]) -> dict[Box, int]:
    """Each distinct box -> the lowest rank holding it (the one that writes or sends it)."""
    owner: dict[Box, int] = {}
    for r, items in enumerate(metas):
        for m in items:
            owner.setdefault((m["key"], tuple(m["offset"]), tuple(m["local_shape"])), r)
    return owner


def overlap(a_off: list[int], a_shape: list[int], b_off: list[int], b_shape: list[int]
            ) -> tuple[list[int], list[int]] | None:
    """``(lo, hi)`` corners of the intersection of two boxes, or None when they don't meet."""
    lo = [max(x, y) for x, y in zip(a_off, b_off, strict=True)]
    hi = [min(x + n, y + m) for x, n, y, m in zip(a_off, a_shape, b_off, b_shape, strict=True)]
    if any(h <= low for low, h in zip(lo, hi, strict=True)):
        return None
    return lo, hi


def show_keys(keys: list[str], n: int = 8) -> str:
    return ", ".join(repr(k) for k in keys[:n]) + (f" ... ({len(keys) - n} more)"
                                                   if len(keys) > n else "")


#: Error types a rank may re-raise for a peer's failure (anything else: CheckpointError).
_SHARED_ERRORS: dict[str, type[Exception]] = {
    cls.__name__: cls for cls in (CheckpointError, CorruptCheckpointError, FileNotFoundError)}


def agree_or_raise(error: Exception | None) -> None:
    """Raise on every rank if any rank failed: the failing rank its own error, the others the
    first failure's type and message, naming its rank. Collective."""
    platform = get_platform()
    errors = platform.all_gather_object(
        None if error is None else (type(error).__name__, str(error)))
    bad = [(r, e) for r, e in enumerate(errors) if e is not None]
    if not bad:
        return
    if error is not None:
        raise error
    r, (name, message) = bad[0]
    cls = _SHARED_ERRORS.get(name)
    raise (cls or CheckpointError)(f"rank {r}: {message}" if cls else
                                   f"rank {r}: {name}: {message}")
