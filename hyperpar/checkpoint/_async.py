"""The background half of ``async_save``: write the staged shard, then commit, without a
collective.

A collective issued from a background thread would interleave with the training step's
collectives on the same process group (gloo matches calls by order, not by tag), so everything
collective (the lock, who writes which box, staging errors) runs in the calling thread before
``async_save`` returns, and the background threads coordinate through the checkpoint folder
itself, which every rank already shares (the index names every rank's file):

1. each rank writes its shard under a new name, then a note ``.hyperpar-async-<id>-rank<r>.json``
   (its file's size and digests, or its error), renamed into place so it is never read half
   written;
2. rank 0 waits for every rank's note, builds the index, replaces ``index.json`` atomically
   (the commit: before it the previous checkpoint is the folder's, after it the new one),
   removes the previous save's files and writes ``.hyperpar-async-<id>-outcome.json``;
3. the other ranks wait for that outcome, so every rank's future ends with the same result.

A rank that dies mid-write never writes its note: rank 0 gives up after ``timeout_s`` and
commits nothing, so the folder keeps the previous checkpoint. No framework here: the PyTorch
writer and the numpy path (:mod:`.arrays`, the MindSpore backend) both start their background
write through :func:`start`.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from ._commit import build_index, remove_stale
from ._format import INDEX_FILE, CheckpointError, write_index
from ._lock import release, track_in_flight

__all__ = ["start"]

_POLL_S = 0.02


def _note(path: str, save_id: str, who: str) -> str:
    return os.path.join(path, f".hyperpar-async-{save_id}-{who}.json")


def _rank_note(path: str, save_id: str, rank: int) -> str:
    return _note(path, save_id, f"rank{rank:05d}")


def _put(name: str, value: Any) -> None:
    """Write ``value`` as JSON under ``name`` atomically (a reader never sees half of it)."""
    tmp = name + ".tmp"
    with open(tmp, "w") as f:
        json.dump(value, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, name)


def _wait_for(name: str, deadline: float, what: str) -> Any:
    while not os.path.exists(name):
        if time.monotonic() > deadline:
            raise CheckpointError(what)
        time.sleep(_POLL_S)
    with open(name) as f:
        return json.load(f)


def start(path: str, save_id: str, lock: str | None, rank: int, world: int,
          metas: list[list[dict[str, Any]]], file_format: str,
          write: Callable[[], dict[str, Any]], extend_index: Any, timeout_s: float
          ) -> Future[str]:
    """Run ``write()`` (this rank's staged shard -> ``{"file", "bytes", "digests"}`` or
    ``{"error"}``) and the file-based commit in a background thread; the returned future gives
    the index path or raises :class:`CheckpointError` (on every rank alike). ``lock``: rank 0's
    lock file, released when the thread ends."""
    future: Future[str] = Future()
    future.set_running_or_notify_cancel()

    def run() -> None:
        try:
            future.set_result(_write_and_commit(path, save_id, rank, world, metas,
                                                file_format, write, extend_index, timeout_s))
        except BaseException as exc:  # the future carries it to whoever waits
            future.set_exception(exc)
        finally:
            if lock is not None:
                release(lock, save_id)

    # Not a daemon: an interpreter exiting with a save in flight finishes (and commits) it.
    thread = threading.Thread(target=run, name=f"hyperpar-async-save-{save_id}")
    track_in_flight(future, path)
    thread.start()
    return future


def _write_and_commit(path: str, save_id: str, rank: int, world: int,
                      metas: list[list[dict[str, Any]]], file_format: str,
                      write: Callable[[], dict[str, Any]], extend_index: Any,
                      timeout_s: float) -> str:
    written = write()
    _put(_rank_note(path, save_id, rank), written)
    deadline = time.monotonic() + timeout_s
    outcome_note = _note(path, save_id, "outcome")
    if rank != 0:
        outcome = _wait_for(
            outcome_note, deadline,
            f"async_save: rank 0 did not commit {path} within {timeout_s:g} s (did it die? "
            "HYPERPAR_TIMEOUT sets the limit); the folder keeps the previous checkpoint")
    else:
        outcome = _commit(path, save_id, world, metas, file_format, extend_index, deadline,
                          timeout_s)
        _put(outcome_note, outcome)
    if outcome is not None:
        raise CheckpointError(outcome if rank == 0 else f"rank 0: {outcome}")
    return os.path.join(path, INDEX_FILE)


def _commit(path: str, save_id: str, world: int, metas: list[list[dict[str, Any]]],
            file_format: str, extend_index: Any, deadline: float, timeout_s: float
            ) -> str | None:
    """Rank 0: wait for every rank's note, then commit; None, or why nothing was committed."""
    keep = f"; {path} still holds the previous checkpoint"
    files = []
    for r in range(world):
        try:
            files.append(_wait_for(
                _rank_note(path, save_id, r), deadline,
                f"async_save: rank {r} did not finish writing its shard within {timeout_s:g} s "
                f"(did it die? HYPERPAR_TIMEOUT sets the limit)"))
        except CheckpointError as exc:
            return str(exc) + keep
    failed = [(r, w["error"]) for r, w in enumerate(files) if "error" in w]
    if failed:
        return f"save: rank {failed[0][0]} could not write its shard: {failed[0][1]}" + keep
    try:
        index = build_index(metas, files, file_format, world, save_id)
        if extend_index is not None:
            extend_index(index)
        write_index(path, index, save_id)
        remove_stale(path, {f["file"] for f in files})
    except Exception as exc:
        return f"save: committing {path} failed on rank 0: {type(exc).__name__}: {exc}"
    return None
