"""The framework-neutral steps of a save and a load: the folder lock and save id, who writes
which box, the index of a save, cleaning up, and sharing one rank's failure with all ranks.

The PyTorch :mod:`.writer` / :mod:`.loader` and the numpy path (:mod:`.arrays`, which the
MindSpore backend uses) both run these, so the two write the same folders. No framework here.
"""

from __future__ import annotations

import math
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
    write_index,
)
from ._lock import ConcurrentSaveError, acquire, wait_in_flight

Box = tuple[str, tuple[int, ...], tuple[int, ...]]


def take_lock(path: str, force: bool) -> tuple[str | None, str]:
    """Rank 0 takes the folder's save lock (one save at a time); every rank learns the outcome
    and rank 0's fresh save id before anything is written. Returns ``(lock, save_id)`` (the
    lock file on rank 0, None elsewhere). First waits for this process's ``async_save`` s
    still in flight (their lock is rank 0's). Collective."""
    wait_in_flight(path)
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


def commit(path: str, written: dict[str, Any], metas: list[list[dict[str, Any]]],
           file_format: str, save_id: str, extend_index: Any = None) -> None:
    """Steps 3-4 of a save, after each rank wrote its file (``written``: its
    ``{"file", "bytes", "digests"}`` or ``{"error"}``): every rank learns whether all wrote;
    rank 0 writes the index (``extend_index(index)`` may add to it) and removes stale files;
    every rank learns whether that worked. Raises on every rank otherwise. Collective."""
    platform = get_platform()
    files = platform.all_gather_object(written)  # doubles as the barrier before the commit
    failed = [(r, w["error"]) for r, w in enumerate(files) if "error" in w]
    if failed:
        raise CheckpointError(f"save: rank {failed[0][0]} could not write its shard: "
                              f"{failed[0][1]}; {path} still holds the previous checkpoint")
    outcome = None
    if platform.rank() == 0:
        try:
            index = build_index(metas, files, file_format, platform.world_size(), save_id)
            if extend_index is not None:
                extend_index(index)
            write_index(path, index, save_id)
            remove_stale(path, {f["file"] for f in files})
        except Exception as exc:  # shared below so no rank waits for a commit that failed
            outcome = f"{type(exc).__name__}: {exc}"
    outcome = platform.broadcast_object(outcome, 0)
    if outcome is not None:
        raise CheckpointError(f"save: committing {path} failed on rank 0: {outcome}")


STRICT_HINT = " (pass strict=False to load the matching tensors only)"


def check_keys(shapes: dict[str, Any], index: dict[str, Any], path: str, strict: bool,
               model_only: set[str], hint: str = STRICT_HINT) -> tuple[list[str], list[str]]:
    """``(missing, unexpected)`` keys over all ranks for a model whose keys on this rank have
    the global ``shapes``; ``model_only`` are the saved keys that belong to the model (the
    optimizer's are not). Shape mismatches, and under ``strict`` any missing or unexpected key,
    raise :class:`CheckpointError` on every rank. Collective."""
    saved = index["tensors"]
    problems = [f"{key!r} has global shape {list(shape)} in the model but "
                f"{saved[key]['shape']} in {path}"
                for key, shape in shapes.items()
                if key in saved and list(shape) != saved[key]["shape"]]
    gathered = get_platform().all_gather_object((sorted(shapes), problems))
    model_keys = {k for keys, _ in gathered for k in keys}
    problems = sorted({p for _, ps in gathered for p in ps})
    missing = sorted(model_keys - set(saved))
    unexpected = sorted(model_only - model_keys)
    if strict and missing:
        problems.append(f"{len(missing)} tensor(s) of the model are not in {path}: "
                        f"{show_keys(missing)}")
    if strict and unexpected:
        problems.append(f"{len(unexpected)} tensor(s) in {path} are not in the model: "
                        f"{show_keys(unexpected)}")
    if problems:
        raise CheckpointError("load: " + "; ".join(problems)
                              + (hint if strict and (missing or unexpected) else ""))
    return missing, unexpected


def regions(entry: dict[str, Any], key: str, offset: list[int], shape: list[int]
            ) -> list[tuple[dict[str, Any], tuple[slice, ...], tuple[slice, ...]]]:
    """How to assemble the box (``offset``, ``shape``) of saved tensor ``key``: for every saved
    chunk that overlaps it, ``(chunk, slice of the chunk, slice of the box)``. Raises
    :class:`CorruptCheckpointError` when the chunks do not cover the box."""
    out, covered = [], 0
    for chunk in entry["chunks"]:
        ov = overlap(offset, shape, chunk["offset"], chunk["shape"])
        if ov is None:
            continue
        lo, hi = ov
        src = tuple(slice(a - c, b - c) for a, b, c in zip(lo, hi, chunk["offset"],
                                                           strict=True))
        dst = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offset, strict=True))
        out.append((chunk, src, dst))
        covered += math.prod(b - a for a, b in zip(lo, hi, strict=True))
    if covered != math.prod(shape):
        raise CorruptCheckpointError(
            f"load: the saved chunks of {key!r} cover {covered} of the {math.prod(shape)} "
            f"elements of box offset={offset} shape={shape}; the checkpoint is incomplete")
    return out
