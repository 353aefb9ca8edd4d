"""The count exchange of one dispatch, decided once for every framework: which status word a
rank's input earns, what each rank sends in the small count all-to-all and how the received
rows read back.

Framework-neutral: Python ints and lists. A framework's mechanics measure its tensors (rows,
feature size, whether every value is finite), call :func:`dispatch_status`, send
:func:`count_message`'s rows with its own all-to-all, and hand the received rows to
:func:`read_count_message`; :func:`hyperpar.moe.routing.raise_on_status` then stops every rank
alike before the token all-to-all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .placement import ExpertPlacement

__all__ = ["count_message", "dispatch_status", "read_count_message"]


def dispatch_status(counts: Sequence[int] | None, num_experts: int, rows: int,
                    shape: Sequence[int], dim: int | None,
                    finite: Callable[[], bool] | None) -> int:
    """This rank's status word (:data:`hyperpar.moe.routing.STATUS_MESSAGES`; 0 = fine).

    ``counts``: the tokens per global expert as ints, ``None`` when the counts tensor is not
    1-D; ``rows``/``shape``: ``routed_input``'s; ``dim``: the experts' feature size (``None``:
    unknown, not checked); ``finite``: a call that says whether every token is finite
    (``None``: not checked; called last, only when everything else is fine, since it costs a
    pass over the tokens)."""
    if counts is None or len(counts) != num_experts:
        return 3
    if min(counts, default=0) < 0 or sum(counts) != rows:
        return 1
    if dim is not None and (len(shape) != 2 or int(shape[-1]) != dim):
        return 4
    if finite is not None and rows and not finite():
        return 2
    return 0


def count_message(status: int, counts: Sequence[int],
                  placement: ExpertPlacement) -> list[list[int]]:
    """The ``(ep, num_local + 1)`` rows this rank sends: to ep rank ``d``,
    ``[status, counts of d's experts]`` (zeros when ``status`` marks the input bad)."""
    n = placement.num_local
    if status:
        return [[status] + [0] * n for _ in range(placement.ep)]
    return [[0, *(int(c) for c in counts[d * n:(d + 1) * n])] for d in range(placement.ep)]


def read_count_message(rows: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """``(statuses, recv_counts)`` from the received rows (row ``s`` from ep rank ``s``):
    ``recv_counts`` rank-major, :func:`hyperpar.moe.routing.dispatch_plan`'s layout."""
    return [int(r[0]) for r in rows], [int(c) for r in rows for c in r[1:]]
