"""One save at a time per checkpoint folder: a lock file created with ``O_CREAT | O_EXCL``.

Rank 0 of a saving job holds ``.hyperpar-save.lock`` (its pid, host, save id, start time) from
before any rank writes until the new index is committed and the old files removed. A second job
saving into the same folder finds the lock and fails before writing anything, naming the
holder. A lock left by a crashed job is taken over when its pid is dead on this host; on
another host that cannot be known, so the error says to remove the file (or pass
``save(..., force=True)``) once that job is gone.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from concurrent.futures import Future
from typing import Any

from ._format import CheckpointError

LOCK_FILE = ".hyperpar-save.lock"
#: Locks this process holds (a lock naming this pid but not listed here was left by a save in
#: this process that died without cleaning up, e.g. an interrupted thread).
_HELD: set[str] = set()
#: ``async_save`` futures of this process still writing or committing, with their folders.
_IN_FLIGHT: list[tuple[Future, str]] = []
_log = logging.getLogger("hyperpar.checkpoint")


class ConcurrentSaveError(CheckpointError):
    """Another job is saving into the same checkpoint folder."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _read(lock: str) -> dict[str, Any] | None:
    try:
        with open(lock) as f:
            holder = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # being written right now, or damaged: treat as held by an unknown job
    return holder if isinstance(holder, dict) else {}


def _stale(lock: str, holder: dict[str, Any]) -> bool:
    """True when the holder is known to be gone: a dead pid on this host, or this very
    process without the lock in its list of held locks."""
    pid = holder.get("pid")
    if holder.get("host") != socket.gethostname() or not isinstance(pid, int) or pid <= 0:
        return False
    if pid == os.getpid():
        return lock not in _HELD
    return not _pid_alive(pid)


def acquire(path: str, save_id: str, *, force: bool = False) -> str:
    """Create the lock of folder ``path`` for save ``save_id``; return its path. Raises
    :class:`ConcurrentSaveError` naming the holder when another live job holds it."""
    lock = os.path.join(path, LOCK_FILE)
    me = {"pid": os.getpid(), "host": socket.gethostname(), "save_id": save_id,
          "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    for _ in range(3):  # a stale lock removed by a racing job: retry the create
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _read(lock)
            if holder is None:
                continue  # released between our create and read
            if force or _stale(lock, holder):
                try:
                    os.remove(lock)
                except FileNotFoundError:
                    pass
                continue
            who = (f"pid {holder.get('pid')} on host {holder.get('host')!r} since "
                   f"{holder.get('started')} (save {holder.get('save_id')})"
                   if holder else "an unknown job")
            raise ConcurrentSaveError(
                f"save: another job is saving into {path} right now: {who} holds {lock}. "
                "Two jobs saving into one folder would delete each other's files; save into "
                "another folder, or wait for that save to end. If that job is gone (crashed on "
                "another host), remove the lock file or pass save(..., force=True)") from None
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        _HELD.add(lock)
        return lock
    raise ConcurrentSaveError(f"save: could not take the lock {lock}: other jobs keep "
                              "creating it; is another job saving into the same folder?")


def release(lock: str, save_id: str) -> None:
    """Remove ``lock`` if it is still ours (``force=True`` elsewhere may have taken it)."""
    _HELD.discard(lock)
    holder = _read(lock)
    if holder and holder.get("save_id") == save_id and holder.get("pid") == os.getpid():
        try:
            os.remove(lock)
        except FileNotFoundError:
            pass


def track_in_flight(future: Future, path: str) -> None:
    """Remember an ``async_save`` in flight, so that the next save waits for it."""
    _IN_FLIGHT.append((future, path))


def wait_in_flight(path: str) -> None:
    """Before a new save (async or not): wait until every ``async_save`` this process started
    has committed or failed. Waiting, not refusing: a training loop that saves every N steps
    must not fail because the disk was slow once; each rank waits for its own writes, so no
    collective is involved. A failed earlier save is logged here (its future raises it)."""
    while _IN_FLIGHT:
        future, earlier = _IN_FLIGHT.pop(0)
        if not future.done():
            _log.info("save into %s waits for the async_save into %s still in flight",
                      path, earlier)
        exc = future.exception()
        if exc is not None:
            _log.warning("the async_save into %s failed: %s", earlier, exc)
