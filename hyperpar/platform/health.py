"""Collective health: who is behind when a collective fails, and a cross-rank debug check.

Every collective a :class:`~hyperpar.platform.torch_platform.TorchPlatform` issues is counted
per process group (name + sequence number; a dict update, no communication). When one fails --
a timeout, or the connection to a peer closing -- the ranks that are in it publish their
position in the rendezvous store (which does not depend on the stuck collective), wait briefly
for their peers, and name the rank(s) that never arrived::

    CollectiveError: rank 1 did not reach all_reduce #12 (rank 0 waited 5.0 s in it)

(``#12``: the 12th collective of any kind this process issued on that group.)

A rank that never publishes did not reach the collective (it is stuck elsewhere, or dead). The
error carries ``culprits``; ``hyperpar run`` and :func:`hyperpar.testing.run_distributed` blame
those ranks instead of the rank that reported the timeout.

Debug mode (``HYPERPAR_DEBUG_COLLECTIVES=1``) exchanges each collective's name, dtypes and
shapes through the store *before* issuing it, and raises :class:`CollectiveMismatchError` on
every rank of the group, naming the call and the ranks that disagree. It costs a store round
trip per collective: use it to find a bug, not in production.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

DEBUG_ENV = "HYPERPAR_DEBUG_COLLECTIVES"
_PREFIX = "hyperpar/health"
_TRUE = ("1", "true", "yes", "on")
# Collectives every rank of the group must enter (point-to-point ops are not counted).
COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor",
               "all_to_all_single", "broadcast", "barrier", "all_gather_object",
               "broadcast_object")
_PEER_GONE = ("connection closed", "connection reset", "broken pipe", "connection refused",
              "peer", "socket")


class CollectiveError(RuntimeError):
    """A collective failed and the ranks found out why.

    ``culprits`` are the global ranks to blame (empty when no rank is behind), ``collective``
    and ``seq`` the call (``all_reduce``, 12th on its group), ``reporter`` the rank raising.
    """

    def __init__(self, message: str, *, collective: str, seq: int, culprits: Sequence[int],
                 reporter: int, waited_s: float = 0.0) -> None:
        super().__init__(message)
        self.collective = collective
        self.seq = seq
        self.culprits = list(culprits)
        self.culprit = self.culprits[0] if self.culprits else None
        self.reporter = reporter
        self.waited_s = waited_s


class CollectiveMismatchError(CollectiveError):
    """Ranks issued different collectives, or the same one with different shapes/dtypes."""


_debug: bool | None = None  # read once per process group (reset() forgets it): hot path


def debug_enabled() -> bool:
    """True when ``HYPERPAR_DEBUG_COLLECTIVES`` asks for the cross-rank check (read at the
    first collective of a process group)."""
    global _debug
    if _debug is None:
        _debug = os.environ.get(DEBUG_ENV, "").strip().lower() in _TRUE
    return _debug


# --------------------------------------------------------------------------- counting
class _Counter:
    """Collectives entered by this process, per group (the hot path: one dict update)."""

    def __init__(self) -> None:
        self.counts: dict[Any, int] = {}

    def enter(self, group: Any) -> int:
        key = None if group is None or group is dist.GroupMember.WORLD else group
        seq = self.counts.get(key, 0) + 1
        self.counts[key] = seq
        return seq

    def reset(self) -> None:
        self.counts.clear()


COUNTER = _Counter()


def reset() -> None:
    """Forget the counts (a new process group starts at #1 on every rank) and the debug flag."""
    global _debug
    COUNTER.reset()
    _debug = None


# --------------------------------------------------------------------------- store helpers
def _store() -> Any:
    return dist.distributed_c10d._get_default_store()


def _group_ranks(group: Any) -> list[int]:
    return list(dist.get_process_group_ranks(group or dist.GroupMember.WORLD))


def _timeout_s(platform: Any) -> float:
    timeout = getattr(platform, "_timeout", None)
    return timeout.total_seconds() if timeout is not None else 300.0


def diagnosis_grace_s(timeout_s: float) -> float:
    """How long a failed rank waits for its peers to publish their position (a peer in the
    same collective publishes when its own timeout fires, up to a few seconds later)."""
    return max(2.0, min(0.5 * timeout_s, 15.0))


def _grace_s(platform: Any) -> float:
    return diagnosis_grace_s(_timeout_s(platform))


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).replace('torch.', '')}{list(value.shape)}"
    if isinstance(value, (list, tuple)) and value and all(
            isinstance(v, torch.Tensor) for v in value):
        return "[" + ", ".join(_describe(v) for v in value) + "]"
    return repr(value)


def call_signature(name: str, sig: inspect.Signature, args: tuple, kwargs: dict) -> str:
    """``all_reduce(tensor=float32[4, 7], op='sum')``: what must agree across ranks."""
    bound = sig.bind(None, *args, **kwargs)
    parts = []
    splits = any(bound.arguments.get(k) is not None
                 for k in ("output_split_sizes", "input_split_sizes"))
    for key, value in list(bound.arguments.items())[1:]:
        if key in ("group", "async_op", "output_split_sizes", "input_split_sizes"):
            continue  # split sizes legitimately differ per rank
        if key == "obj":
            parts.append(f"obj={type(value).__name__}")
        elif splits and isinstance(value, torch.Tensor):
            parts.append(f"{key}={str(value.dtype).replace('torch.', '')}")
        else:
            parts.append(f"{key}={_describe(value)}")
    return f"{name}({', '.join(parts)})"


def _poll(store: Any, keys: list[str], deadline: float) -> list[str]:
    """Wait until ``deadline`` for ``keys``; return the ones that appeared."""
    while True:
        present = [k for k in keys if store.check([k])]
        if len(present) == len(keys) or time.monotonic() >= deadline:
            return present
        time.sleep(0.05)


def _ranks_text(ranks: Iterable[int]) -> str:
    ranks = list(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


# --------------------------------------------------------------------------- diagnosis
def _is_peer_failure(exc: BaseException, waited_s: float, timeout_s: float) -> bool:
    text = str(exc).lower()
    return ("timed out" in text or "timeout" in text or waited_s >= 0.9 * timeout_s
            or any(word in text for word in _PEER_GONE)
            or isinstance(exc, getattr(dist, "DistNetworkError", ())))


def diagnose(platform: Any, name: str, seq: int, group: Any, waited_s: float,
             exc: BaseException, signature: str = "") -> CollectiveError | None:
    """Agree with the peers, through the store, on why collective ``name`` #``seq`` failed.

    Returns the error to raise, or ``None`` when the failure is this rank's own (a local
    error, or the store is unreachable): then the original exception stands.
    """
    timeout_s = _timeout_s(platform)
    if not _is_peer_failure(exc, waited_s, timeout_s):
        return None
    try:
        store = _store()
        me = dist.get_rank()
        ranks = _group_ranks(group)
        base = f"{_PREFIX}/{'.'.join(map(str, ranks))}/{seq}"
        record = {"name": name, "rank": me, "signature": signature, "waited": waited_s}
        store.set(f"{base}/{me}", json.dumps(record))
        keys = [f"{base}/{r}" for r in ranks]
        present = set(_poll(store, keys, time.monotonic() + _grace_s(platform)))
        records = [json.loads(store.get(k)) for k in keys if k in present]
    except Exception:  # the store is gone too (its host died): keep the original error
        return None
    missing = [r for r, k in zip(ranks, keys, strict=True) if k not in present]
    where = f"{name} #{seq}"
    cause = f"\n  (the backend said: {str(exc).strip().splitlines()[0][:300]})"
    if missing:
        gone = any(word in str(exc).lower() for word in _PEER_GONE)
        why = ("; its connection closed: it has probably exited" if gone
               else "; it is stuck elsewhere or has exited")
        return CollectiveError(
            f"{_ranks_text(missing)} did not reach {where} (rank {me} waited {waited_s:.1f} s "
            f"in it{why}){cause}",
            collective=name, seq=seq, culprits=missing, reporter=me, waited_s=waited_s)
    names = {rec["name"] for rec in records}
    signatures = {rec["signature"] for rec in records}
    if len(names) > 1 or len(signatures) > 1:
        rows = "; ".join(f"rank {rec['rank']}: {rec['signature'] or rec['name']}"
                         for rec in records)
        return CollectiveMismatchError(
            f"collective #{seq} of group {ranks} differs across ranks: {rows}{cause}",
            collective=name, seq=seq, culprits=[], reporter=me, waited_s=waited_s)
    return None


def check_before(platform: Any, name: str, seq: int, group: Any, signature: str) -> None:
    """Debug mode: every rank of the group publishes ``signature`` and compares; raise
    :class:`CollectiveMismatchError` (on every rank) or :class:`CollectiveError` naming ranks
    that do not arrive within the collective timeout."""
    store = _store()
    me = dist.get_rank()
    ranks = _group_ranks(group)
    base = f"{_PREFIX}/debug/{'.'.join(map(str, ranks))}"
    store.set(f"{base}/{seq}/{me}", signature)
    if seq > 1:  # every rank published seq - 1 after reading seq - 2: safe to drop ours
        try:
            store.delete_key(f"{base}/{seq - 2}/{me}")
        except Exception:
            pass
    keys = [f"{base}/{seq}/{r}" for r in ranks]
    start = time.monotonic()
    present = set(_poll(store, keys, start + _timeout_s(platform)))
    missing = [r for r, k in zip(ranks, keys, strict=True) if k not in present]
    if missing:
        raise CollectiveError(
            f"{_ranks_text(missing)} did not reach {name} #{seq} (rank {me} waited "
            f"{time.monotonic() - start:.1f} s for it; {DEBUG_ENV} check)",
            collective=name, seq=seq, culprits=missing, reporter=me)
    seen = {r: store.get(k).decode() for r, k in zip(ranks, keys, strict=True)}
    if len(set(seen.values())) > 1:
        rows = "; ".join(f"rank {r}: {s}" for r, s in seen.items())
        raise CollectiveMismatchError(
            f"collective #{seq} of group {ranks} differs across ranks: {rows}. Every rank of "
            f"the group must issue the same collective with the same dtypes and shapes",
            collective=name, seq=seq, culprits=[], reporter=me)


# --------------------------------------------------------------------------- instrumentation
class _TrackedWork:
    """An async Work handle whose ``wait`` runs the same diagnosis as a blocking call."""

    def __init__(self, work: Any, on_error: Callable[[BaseException], BaseException | None]):
        self._work, self._on_error = work, on_error

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self._work.wait(*args, **kwargs)
        except Exception as exc:
            better = self._on_error(exc)
            if better is None:
                raise
            raise better from exc

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._work, attr)


def _wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    sig = inspect.signature(fn)
    params = list(sig.parameters)[1:]  # without self
    group_at = params.index("group")
    async_at = params.index("async_op") if "async_op" in params else None

    @functools.wraps(fn)
    def tracked(self: Any, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            # Inside a compiled graph: no store, no clock (see platform/traced.py).
            return fn(self, *args, **kwargs)
        group = kwargs.get("group", args[group_at] if len(args) > group_at else None)
        seq = COUNTER.enter(group)
        signature = ""
        if debug_enabled():
            signature = call_signature(name, sig, args, kwargs)
            check_before(self, name, seq, group, signature)
        start = time.monotonic()

        def on_error(exc: BaseException) -> BaseException | None:
            if isinstance(exc, CollectiveError):
                return None
            text = signature
            if not text:
                try:
                    text = call_signature(name, sig, args, kwargs)
                except Exception:
                    text = name
            return diagnose(self, name, seq, group, time.monotonic() - start, exc, text)

        try:
            result = fn(self, *args, **kwargs)
        except Exception as exc:
            better = on_error(exc)
            if better is None:
                raise
            raise better from exc
        is_async = kwargs.get("async_op", args[async_at] if async_at is not None
                              and len(args) > async_at else False)
        if is_async and result is not None:
            return _TrackedWork(result, on_error)
        return result

    tracked.__hyperpar_tracked__ = True  # type: ignore[attr-defined]
    return tracked


def instrument(cls: type, names: Sequence[str] = COLLECTIVES) -> type:
    """Count and diagnose the collectives ``names`` of ``cls`` (idempotent)."""
    for name in names:
        fn = cls.__dict__.get(name)
        if fn is not None and not getattr(fn, "__hyperpar_tracked__", False):
            setattr(cls, name, _wrap(name, fn))
    destroy = cls.__dict__.get("destroy_process_group")
    if destroy is not None and not getattr(destroy, "__hyperpar_tracked__", False):
        @functools.wraps(destroy)
        def destroy_and_reset(self: Any) -> None:
            destroy(self)
            reset()  # a new group counts from #1 again on every rank

        destroy_and_reset.__hyperpar_tracked__ = True  # type: ignore[attr-defined]
        cls.destroy_process_group = destroy_and_reset  # type: ignore[attr-defined]
    return cls


# --------------------------------------------------------------------------- failure notices
# Point-to-point traffic (pipelines) has no "every rank enters it" rule, so a peer that fails
# shows up only as a receive that times out or a closed connection. A rank that fails on its
# own publishes a notice in the store *before* it raises (the store outlives its process when
# the launcher hosts it); the peers read it when their send/recv fails and name that rank.
class _P2PCounter:
    """Point-to-point messages posted by this process, per (direction, peer global rank)."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, int], int] = {}

    def enter(self, kind: str, peer: int) -> int:
        seq = self.counts.get((kind, peer), 0) + 1
        self.counts[(kind, peer)] = seq
        return seq

    def count(self, kind: str, peer: int) -> int:
        return self.counts.get((kind, peer), 0)


P2P_COUNTER = _P2PCounter()


def is_peer_failure(exc: BaseException, platform: Any = None) -> bool:
    """True when ``exc`` (from a collective or send/recv) says a peer went away or never
    answered -- a timeout or a closed connection -- rather than a local error."""
    if isinstance(exc, CollectiveError):
        return True
    timeout_s = _timeout_s(platform) if platform is not None else 300.0
    return _is_peer_failure(exc, 0.0, timeout_s)


def publish_failure(scope: str, record: dict[str, Any]) -> None:
    """Leave a failure notice ``record`` (JSON-able) under ``scope`` for the peers; a no-op
    when there is no process group or the store is unreachable."""
    try:
        if not dist.is_initialized():
            return
        _store().set(f"{_PREFIX}/fail/{scope}", json.dumps(record))
    except Exception:
        pass


def await_failure(scope: str, platform: Any = None) -> dict[str, Any] | None:
    """The notice a peer left under ``scope``, waiting up to the diagnosis grace period for it
    (a peer that failed publishes before its connection closes, but a peer stuck in a timeout
    of its own publishes later); ``None`` when none appears or the store is gone."""
    try:
        if not dist.is_initialized():
            return None
        store = _store()
        key = f"{_PREFIX}/fail/{scope}"
        grace = _grace_s(platform) if platform is not None else 2.0
        if not _poll(store, [key], time.monotonic() + grace):
            return None
        return json.loads(store.get(key))
    except Exception:
        return None
