"""Routing bookkeeping for expert-parallel dispatch: counts in, split sizes and orders out.

Framework-neutral: Python ints and lists. The per-token work (sorting tokens by expert id,
``index_select``, the all-to-alls) is each framework's mechanics; this module decides the sizes
and orders they use, so torch and MindSpore dispatch the same way.

The dispatch of one MoE layer on one ep rank (torchtitan's all-to-all token dispatcher):

1. The block sorts its routed tokens by *global* expert id and counts them:
   ``send_counts[e]`` tokens for expert ``e`` (length ``num_experts``).
2. Count exchange: rank ``r`` sends ``send_counts[block of dst]`` to each ``dst``; it receives
   ``recv_counts`` laid out rank-major, ``recv_counts[s * n_local + j]`` = tokens source rank
   ``s`` sends to local expert ``j`` (:func:`reference_count_exchange` is the one-process model).
3. Token all-to-all with :attr:`DispatchPlan.input_splits` / :attr:`DispatchPlan.output_splits`.
   The received buffer is rank-major: ``[s=0: j=0, j=1, ...][s=1: j=0, ...]``.
4. Regroup expert-major (every local expert's tokens contiguous, in source-rank order) with
   :attr:`DispatchPlan.segment_order` over the buffer split into :attr:`segment_sizes`;
   the experts run on :attr:`tokens_per_local_expert`.
5. Combine: undo 4 with :attr:`inverse_segment_order` and send back with the splits swapped.

Capacity (token dropping), :func:`capacity_keep`: applied on the sending rank to its own batch,
before step 1. **Drop order:** assignments are visited choice-major, then in token order --
every token's first choice (tokens 0, 1, 2, ...), then every token's second choice, ... -- and
an assignment is kept while its expert has accepted fewer than ``capacity`` assignments. This
is DeepSpeed's ``top2gating`` / GShard order (first choices fill experts before second
choices; within a choice, earlier tokens win). Dropped assignments contribute zero.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .errors import MoERoutingError
from .placement import ExpertPlacement

__all__ = [
    "DispatchPlan",
    "STATUS_MESSAGES",
    "capacity_keep",
    "check_counts",
    "check_expert_ids",
    "dispatch_plan",
    "expand_segments",
    "inverse_permutation",
    "raise_on_status",
    "reference_count_exchange",
    "stable_sort_by_expert",
]


def _ints(name: str, values: Sequence[int]) -> list[int]:
    out = [int(v) for v in values]
    if any(v < 0 for v in out):
        raise MoERoutingError(f"{name} must be >= 0, got {out}")
    return out


def check_counts(counts: Sequence[int], num_experts: int, num_rows: int | None = None) -> list[int]:
    """``counts`` as ints: one per global expert, none negative, summing to ``num_rows``."""
    out = _ints("tokens-per-expert counts", counts)
    if len(out) != num_experts:
        raise MoERoutingError(
            f"num_tokens_per_expert has {len(out)} entries, but the experts hold "
            f"{num_experts}: pass one count per global expert")
    if num_rows is not None and sum(out) != num_rows:
        raise MoERoutingError(
            f"num_tokens_per_expert sums to {sum(out)}, but routed_input has {num_rows} rows: "
            f"the counts must describe the routed tokens, sorted by global expert id")
    return out


def check_expert_ids(expert_ids: Sequence[Sequence[int]], num_experts: int) -> None:
    """Every id in ``[0, num_experts)``, no token routed twice to one expert."""
    for t, row in enumerate(expert_ids):
        for e in row:
            if not 0 <= e < num_experts:
                raise MoERoutingError(
                    f"token {t} is routed to expert {e}, outside [0, {num_experts})")
        if len(set(row)) != len(row):
            raise MoERoutingError(f"token {t} is routed to one expert twice: {list(row)}")


@dataclass(frozen=True)
class DispatchPlan:
    """Split sizes and segment orders for one rank's dispatch and combine.

    ``input_splits[d]``: rows this rank sends to ep rank ``d`` (its tokens for ``d``'s experts).
    ``output_splits[s]``: rows it receives from ep rank ``s``.
    ``segment_sizes``: the received buffer's segments, rank-major (``s * n_local + j``).
    ``segment_order``: the segments in expert-major order (``j`` outer, ``s`` inner);
    concatenating ``segments[i] for i in segment_order`` groups tokens by local expert.
    ``inverse_segment_order``: the same for the expert-major buffer split into
    :attr:`expert_major_sizes`, giving the rank-major order back.
    ``tokens_per_local_expert[j]``: rows local expert ``j`` computes.
    """

    ep: int
    num_local: int
    input_splits: tuple[int, ...]
    output_splits: tuple[int, ...]
    segment_sizes: tuple[int, ...]
    segment_order: tuple[int, ...]
    expert_major_sizes: tuple[int, ...]
    inverse_segment_order: tuple[int, ...]
    tokens_per_local_expert: tuple[int, ...]

    def permutation(self) -> list[int]:
        """Per row: the index in the received (rank-major) buffer of the ``i``-th row of the
        expert-major buffer (``grouped = received[perm]``)."""
        return expand_segments(self.segment_sizes, self.segment_order)

    def inverse(self) -> list[int]:
        """Per row: the index in the expert-major buffer of received row ``i``."""
        return inverse_permutation(self.permutation())


def dispatch_plan(send_counts: Sequence[int], recv_counts: Sequence[int],
                  placement: ExpertPlacement) -> DispatchPlan:
    """The :class:`DispatchPlan` from this rank's counts per global expert (``send_counts``,
    length ``num_experts``) and what the count exchange gave it (``recv_counts``, length
    ``ep * n_local``, rank-major)."""
    ep, n_local = placement.ep, placement.num_local
    send = check_counts(send_counts, placement.num_experts)
    recv = _ints("received counts", recv_counts)
    if len(recv) != ep * n_local:
        raise MoERoutingError(
            f"received {len(recv)} counts, expected ep * local experts = {ep} * {n_local}")
    input_splits = tuple(sum(send[d * n_local:(d + 1) * n_local]) for d in range(ep))
    output_splits = tuple(sum(recv[s * n_local:(s + 1) * n_local]) for s in range(ep))
    order = tuple(s * n_local + j for j in range(n_local) for s in range(ep))
    em_sizes = tuple(recv[i] for i in order)
    inverse = tuple(sorted(range(len(order)), key=order.__getitem__))
    per_expert = tuple(sum(recv[s * n_local + j] for s in range(ep)) for j in range(n_local))
    return DispatchPlan(ep, n_local, input_splits, output_splits, tuple(recv), order,
                        em_sizes, inverse, per_expert)


def reference_count_exchange(all_send_counts: Sequence[Sequence[int]],
                             placement: ExpertPlacement) -> list[list[int]]:
    """One-process model of the count all-to-all: ``all_send_counts[r]`` is rank ``r``'s
    counts per global expert; returns each rank's ``recv_counts`` (rank-major)."""
    ep, n = placement.ep, placement.num_local
    if len(all_send_counts) != ep:
        raise MoERoutingError(f"need one count list per ep rank ({ep}), got {len(all_send_counts)}")
    return [[int(all_send_counts[s][d * n + j]) for s in range(ep) for j in range(n)]
            for d in range(ep)]


def expand_segments(sizes: Sequence[int], order: Sequence[int]) -> list[int]:
    """Row indices of a buffer split into ``sizes``, taken segment by segment in ``order``."""
    starts = [0]
    for s in sizes[:-1]:
        starts.append(starts[-1] + s)
    return [starts[i] + k for i in order for k in range(sizes[i])]


def inverse_permutation(perm: Sequence[int]) -> list[int]:
    """``inv`` with ``inv[perm[i]] == i``; refuses a list that is not a permutation."""
    inv = [-1] * len(perm)
    for i, p in enumerate(perm):
        if not 0 <= p < len(perm) or inv[p] != -1:
            raise MoERoutingError(f"not a permutation of range({len(perm)}): {list(perm)}")
        inv[p] = i
    return inv


def stable_sort_by_expert(expert_ids: Sequence[int],
                          num_experts: int) -> tuple[list[int], list[int]]:
    """The order that sorts flat assignments by expert id, ties kept in input order (what
    ``argsort(stable=True)`` gives), and the count per expert (``histc``/``bincount``)."""
    counts = [0] * num_experts
    for e in expert_ids:
        if not 0 <= e < num_experts:
            raise MoERoutingError(f"expert id {e} outside [0, {num_experts})")
        counts[e] += 1
    order = sorted(range(len(expert_ids)), key=expert_ids.__getitem__)
    return order, counts


def capacity_keep(expert_ids: Sequence[Sequence[int]], num_experts: int,
                  capacity: int) -> list[list[bool]]:
    """Which ``(token, choice)`` assignments survive a per-expert ``capacity``.

    ``expert_ids[t][c]`` is token ``t``'s ``c``-th choice. Visited choice-major, then in token
    order; an assignment is kept while its expert has fewer than ``capacity`` kept (the module
    docstring's drop order). Each expert keeps ``min(capacity, assigned)`` assignments.
    """
    if capacity < 0:
        raise MoERoutingError(f"capacity must be >= 0, got {capacity}")
    check_expert_ids(expert_ids, num_experts)
    k = len(expert_ids[0]) if expert_ids else 0
    if any(len(row) != k for row in expert_ids):
        raise MoERoutingError("every token needs the same number of choices (top_k)")
    taken = [0] * num_experts
    keep = [[False] * k for _ in expert_ids]
    for c in range(k):
        for t, row in enumerate(expert_ids):
            e = row[c]
            if taken[e] < capacity:
                taken[e] += 1
                keep[t][c] = True
    return keep


#: Status words a rank folds into the count exchange, so a bad input on one rank stops every
#: rank (each raises after the small count all-to-all, before the token all-to-all).
STATUS_MESSAGES: dict[int, str] = {
    1: "num_tokens_per_expert does not sum to routed_input's rows (or has a negative count)",
    2: "routed_input contains NaN or inf (often NaN router scores multiplied into the tokens)",
    3: "num_tokens_per_expert has a different length than the experts' num_experts",
    4: "routed_input is not (tokens, dim) with the experts' dim (hidden sizes differ)",
    5: "router scores contain NaN or inf",
}


def raise_on_status(statuses: Sequence[int], what: str = "expert-parallel dispatch",
                    detail: str = "") -> None:
    """Raise :class:`MoERoutingError` on every rank if any ep rank reported a bad input;
    ``statuses[s]`` is ep rank ``s``'s status word (0 = fine). ``detail``: this rank's own
    account of its bad input, appended to its message."""
    bad = {s: int(code) for s, code in enumerate(statuses) if int(code)}
    if bad:
        lines = "; ".join(f"ep rank {s}: {STATUS_MESSAGES.get(c, f'status {c}')}"
                          for s, c in sorted(bad.items()))
        tail = f" (here: {detail})" if detail else ""
        raise MoERoutingError(f"{what} refused before the token all-to-all: {lines}{tail}")
