"""Name the stage that failed, on every rank of a pipeline.

A stage that raises (a bad layer, a wrong activation shape, a missing target, a shape change
between steps) fails on its own rank with a clear error -- but its neighbours only see their
send/recv time out or the connection close. Here the failing rank leaves a notice in the
rendezvous store before it raises (:func:`hyperpar.platform.health.publish_failure`), and a rank
whose point-to-point transfer fails reads it and raises :class:`PipelineStageError`::

    PipelineStageError: stage 1 (rank 1) failed: ValueError: bad activation

With no notice (the peer was killed, or is stuck elsewhere) the error names the peer the
transfer was waiting on. Notices are keyed by the pipeline's ranks and the step number, which
every rank of a pipeline counts alike (one per ``step``/``eval_step``/``train_batch``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from hyperpar.platform import get_platform

_HANDLED = "__hyperpar_pipeline_handled__"


class PipelineStageError(RuntimeError):
    """Another stage of the pipeline failed (``culprits``: its global rank), or stopped
    answering; raised on the ranks that were waiting for it."""

    def __init__(self, message: str, *, stage: int | None, rank: int) -> None:
        super().__init__(message)
        self.stage = stage
        self.rank = rank
        self.culprits = [rank]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:400] if text else ''}".rstrip(": ")


def _scope(module: Any) -> str:
    ranks = ".".join(map(str, module.stage_ranks))
    return f"pipeline/{ranks}/{getattr(module, '_hp_fault_step', 0)}"


def _stage_of_rank(module: Any, rank: int) -> int | None:
    ranks = list(module.stage_ranks)
    return ranks.index(rank) if rank in ranks else None


@contextlib.contextmanager
def pipeline_step(module: Any, current_stage: Callable[[], int | None] = lambda: None,
                  current_peers: Callable[[], Sequence[int]] = tuple) -> Iterator[None]:
    """Run one pipeline step (re-entrant: the engine's ``train_batch`` wraps the schedule's
    step, which counts as the same step). ``current_stage()`` is the stage this rank was
    working on, ``current_peers()`` the global ranks a failing transfer was talking to."""
    depth = getattr(module, "_hp_fault_depth", 0)
    if depth == 0:
        module._hp_fault_step = getattr(module, "_hp_fault_step", 0) + 1
    module._hp_fault_depth = depth + 1
    try:
        yield
    except Exception as exc:
        if getattr(exc, _HANDLED, False) or len(module.stage_ranks) < 2:
            raise
        better = _handle(module, exc, current_stage(), list(current_peers()))
        try:
            setattr(exc, _HANDLED, True)
        except Exception:
            pass
        if better is None:
            raise
        setattr(better, _HANDLED, True)
        raise better from exc
    finally:
        module._hp_fault_depth = depth


def _handle(module: Any, exc: BaseException, stage: int | None,
            peers: list[int]) -> BaseException | None:
    # torch's rendezvous store, imported here so PipelineStageError imports no framework
    from hyperpar.platform.health import (
        P2P_COUNTER,
        await_failure,
        is_peer_failure,
        publish_failure,
    )

    platform = get_platform()
    me = platform.rank()
    stage = module.stage_id if stage is None else stage
    scope = _scope(module)
    in_transfer = bool(peers) and not isinstance(exc, ValueError | TypeError)
    if not (in_transfer and is_peer_failure(exc, platform)):
        # This rank's own failure: tell the others before the exception unwinds the process.
        publish_failure(scope, {"stage": stage, "rank": me, "error": _first_line(exc)})
        return None
    notice = await_failure(scope, platform)
    seen = f"\n  (rank {me}, stage {stage}, saw: {_first_line(exc)})"
    if notice is not None and notice.get("rank") != me:
        return PipelineStageError(
            f"stage {notice['stage']} (rank {notice['rank']}) failed: {notice['error']}{seen}",
            stage=notice["stage"], rank=int(notice["rank"]))
    peers = [p for p in peers if p != me]
    if not peers:
        return None
    peer = peers[0]
    got = P2P_COUNTER.count("recv", peer)
    gone = "closed" in str(exc).lower() or "reset" in str(exc).lower()
    why = "its connection closed: it has probably exited" if gone else \
        "it is stuck elsewhere or has exited"
    return PipelineStageError(
        f"stage {_stage_of_rank(module, peer)} (rank {peer}) stopped answering: transfer "
        f"#{got} from it in this process failed ({why}); its own error, if any, is in its "
        f"output{seen}",
        stage=_stage_of_rank(module, peer), rank=peer)
