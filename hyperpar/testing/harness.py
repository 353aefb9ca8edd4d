"""Run a function on N real processes and bring back results or the first rank's failure.

Two entry points:

* :func:`run_distributed` -- fresh spawned processes for one call (simple, ~2 s start-up).
* :class:`WorkerPool` -- N processes that join the process group once and then run many
  functions; a failure or timeout tears the pool down so the next call starts clean. Test
  suites use this to avoid paying process start-up per test.

Functions must be picklable (defined at module level). Each process selects the backend given
by ``backend`` (default: ``HYPERPAR_BACKEND`` or auto-detect), optionally runs ``setup`` (e.g. a
device emulation) first, and joins the group through the Platform -- never ``torch.distributed``
directly -- with a collective timeout, so a hang raises instead of blocking.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

DEFAULT_TIMEOUT_S = 120.0
_ABORT_HINT = (" (SIGABRT: a native abort, e.g. the collective library finding that ranks sent "
               "different sizes; its stack is on the rank's stderr. Rerun with "
               "HYPERPAR_DEBUG_COLLECTIVES=1 to name the mismatching call and ranks)")


class DistributedError(RuntimeError):
    """A rank raised, died, or did not finish in time. ``rank`` names the first culprit."""

    def __init__(self, message: str, rank: int | None = None, remote_traceback: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback


def free_port() -> int:
    """A TCP port on localhost that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _failure_report(exc: BaseException) -> tuple[str, list[int], str]:
    """(traceback, culprit ranks, diagnosis) of an exception raised on a rank: a failed
    collective's diagnosis (hyperpar.platform.health) names the ranks that held it up."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    seen: BaseException | None = exc
    for _ in range(20):
        if seen is None:
            break
        if getattr(seen, "culprits", None):
            return text, [int(r) for r in seen.culprits], str(seen).splitlines()[0]
        seen = seen.__cause__ or seen.__context__
    return text, [], ""


def _exit_with_parent(poll_s: float = 1.0) -> None:
    """End this worker when the process that started it dies (a killed pytest run, a CI job
    cancelled): daemon workers are reparented, not killed, and would otherwise wait on their
    inbox forever."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="hyperpar-exit-with-parent", daemon=True).start()


def _worker_main(rank: int, world_size: int, port: int, backend: str | None,
                 setup: Callable[[], None] | None, collective_timeout_s: float,
                 env: dict[str, str], inbox: Any, outbox: Any) -> None:
    _exit_with_parent()
    os.environ.update(env)
    os.environ.update({
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
        "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size), "HYPERPAR_TIMEOUT": str(collective_timeout_s),
    })
    if backend:
        os.environ["HYPERPAR_BACKEND"] = backend
    try:
        try:
            import torch
        except ImportError:  # a MindSpore-only venv: its platform sets its own threads
            torch = None
        if torch is not None:
            # Ranks share the machine's cores; oversubscribing them makes every test slower.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        if setup is not None:
            setup()
        from hyperpar.platform import get_platform

        platform = get_platform()
        # Join only once every rank is past its (slow, load-dependent) imports: the join's
        # own timeout is the collective timeout, which tests keep to a few seconds.
        outbox.put((rank, None, True, "imported"))
        if inbox.get() != "join":
            return
        platform.init_process_group(timeout_s=collective_timeout_s)
    except BaseException as exc:
        outbox.put((rank, None, False, _failure_report(exc)))
        return
    outbox.put((rank, None, True, "ready"))
    while True:
        task = inbox.get()
        if task is None:
            break
        task_id, fn, args, kwargs = task
        try:
            result = fn(*args, **kwargs)
            # Pickle here: a queue pickles in a background thread, where a failure would be
            # printed and lost, leaving the parent to wait for its timeout.
            payload = pickle.dumps(result)
        except BaseException as exc:
            outbox.put((rank, task_id, False, _failure_report(exc)))
            continue
        outbox.put((rank, task_id, True, payload))
    try:
        platform.destroy_process_group()
    except Exception:
        pass


class WorkerPool:
    """``world_size`` processes joined in one process group, reused across calls.

    >>> with WorkerPool(2) as pool:                     # doctest: +SKIP
    ...     results = pool.run(my_fn, 3.0)              # my_fn(3.0) on both ranks
    """

    def __init__(self, world_size: int, *, backend: str | None = None,
                 setup: Callable[[], None] | None = None,
                 collective_timeout_s: float = 60.0, start_timeout_s: float = 120.0,
                 env: dict[str, str] | None = None) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.backend = backend
        self.setup = setup
        self.collective_timeout_s = collective_timeout_s
        self.start_timeout_s = start_timeout_s
        self.env = dict(env or {})
        self._procs: list[Any] = []
        self._inboxes: list[Any] = []
        self._outbox: Any = None
        self._task = 0

    # -------------------------------------------------------------- lifecycle
    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._outbox = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(self.world_size)]
        port = free_port()
        self._procs = [
            ctx.Process(
                target=_worker_main,
                args=(r, self.world_size, port, self.backend, self.setup,
                      self.collective_timeout_s, self.env, self._inboxes[r], self._outbox),
                daemon=True, name=f"hyperpar-rank{r}",
            )
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()
        self._collect(None, self.start_timeout_s, what="start-up")  # every rank imported
        for box in self._inboxes:
            box.put("join")
        self._collect(None, self.start_timeout_s, what="start-up")  # every rank joined

    def close(self) -> None:
        """Stop every worker (politely, then by force)."""
        for box in self._inboxes:
            try:
                box.put(None)
            except Exception:
                pass
        deadline = time.monotonic() + 5
        for p in self._procs:
            if p.pid is not None:
                p.join(max(0.0, deadline - time.monotonic()))
        self._kill()

    def _kill(self) -> None:
        started = [p for p in self._procs if p.pid is not None]
        for p in started:
            if p.is_alive():
                p.kill()
        for p in started:
            p.join(5)
        self._procs, self._inboxes, self._outbox = [], [], None

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -------------------------------------------------------------- running
    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float = DEFAULT_TIMEOUT_S,
            **kwargs: Any) -> list[Any]:
        """Call ``fn(*args, **kwargs)`` on every rank; return the per-rank results in rank order.

        Raises :class:`DistributedError` naming the first rank that raised (with its traceback),
        a rank that died, or the ranks still running after ``timeout_s``. After a failure the
        pool restarts on the next call.
        """
        try:
            pickle.dumps((fn, args, kwargs))
        except Exception as exc:
            raise DistributedError(
                f"cannot send {getattr(fn, '__qualname__', fn)!r} to the ranks: {exc}. Define "
                "the function at module level and pass picklable arguments."
            ) from exc
        if not self._procs:
            self._start()
        self._task += 1
        for box in self._inboxes:
            box.put((self._task, fn, args, kwargs))
        return self._collect(self._task, timeout_s, what=getattr(fn, "__qualname__", str(fn)))

    def _dead(self, finished: dict[int, Any]) -> list[tuple[int, int | None]]:
        return [(r, p.exitcode) for r, p in enumerate(self._procs)
                if not p.is_alive() and r not in finished]

    def _collect(self, task_id: int | None, timeout_s: float, what: str) -> list[Any]:
        results: dict[int, Any] = {}
        # A collective that times out on a rank is diagnosed there (health.py: the ranks agree
        # on who is behind, within a grace period); leave time for that report to arrive.
        grace = 0.0
        if self.collective_timeout_s <= timeout_s:
            try:  # health.py is torch's collective diagnosis: imported here, where it applies
                from hyperpar.platform.health import diagnosis_grace_s
            except ImportError:  # no torch, no diagnosis to wait for
                diagnosis_grace_s = None
            if diagnosis_grace_s is not None:
                grace = diagnosis_grace_s(self.collective_timeout_s) + 2.0
        deadline = time.monotonic() + timeout_s + grace
        while len(results) < self.world_size:
            try:
                rank, tid, ok, value = self._outbox.get(timeout=0.2)
            except queue.Empty:
                dead = self._dead(results)
                if dead:
                    self._kill()
                    r, code = dead[0]
                    raise DistributedError(
                        f"{what}: rank {r} died (exit code {code}) without reporting a result"
                        f"{_ABORT_HINT if code == -6 else ''}",
                        rank=r,
                    ) from None
                if time.monotonic() > deadline:
                    pending = sorted(set(range(self.world_size)) - set(results))
                    self._kill()
                    done = sorted(results)
                    also = (f" while ranks {done} finished: the ranks still running are "
                            f"behind" if done else " (a collective waiting for a peer?)")
                    raise DistributedError(
                        f"{what}: timed out after {timeout_s:.0f} s; ranks {pending} never "
                        f"finished{also}",
                        rank=pending[0],
                    ) from None
                continue
            if tid != task_id:
                continue  # a late answer of an earlier, failed task
            if not ok:
                raise self._failure(what, rank, *value)
            results[rank] = pickle.loads(value) if task_id is not None else value
        return [results[r] for r in range(self.world_size)]

    def _failure(self, what: str, rank: int, tb: str, culprits: list[int],
                 diagnosis: str) -> DistributedError:
        """The error for ``rank``'s failure, blaming the rank that caused it: the one its
        collective diagnosis names, else a rank that died meanwhile, else ``rank`` itself."""
        if culprits:
            self._kill()
            return DistributedError(
                f"{what}: {diagnosis}\n(reported by rank {rank} of {self.world_size}:)\n{tb}",
                rank=culprits[0], remote_traceback=tb)
        # A peer that died makes the survivors' collectives fail at once, often before the
        # death is seen here: look for a dead rank for a moment before blaming this one.
        until = time.monotonic() + 1.0
        dead = self._dead({rank: None})
        while not dead and time.monotonic() < until:
            time.sleep(0.05)
            dead = self._dead({rank: None})
        crashed = [(r, code) for r, code in dead if code != 0]
        self._kill()
        if crashed:
            r, code = crashed[0]
            return DistributedError(
                f"{what}: rank {r} died (exit code {code}) without reporting a result"
                f"{_ABORT_HINT if code == -6 else ''}; rank {rank} then failed:\n{tb}",
                rank=r, remote_traceback=tb)
        return DistributedError(f"{what}: rank {rank} of {self.world_size} raised:\n{tb}",
                                rank=rank, remote_traceback=tb)


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any,
                    backend: str | None = None, setup: Callable[[], None] | None = None,
                    timeout_s: float = DEFAULT_TIMEOUT_S, **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` fresh processes; return per-rank results.

    Collectives time out after ``timeout_s`` too, so a missing peer fails the call.
    """
    with WorkerPool(world_size, backend=backend, setup=setup,
                    collective_timeout_s=timeout_s) as pool:
        return pool.run(fn, *args, timeout_s=timeout_s, **kwargs)
