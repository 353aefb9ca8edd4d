"""The schedules: pure functions ``plan(n_stages, n_microbatches, rank, n_ranks=None)`` ->
the rank's ordered compute actions (GPipe, 1F1B, interleaved 1F1B, zero bubble, ZBV,
interleaved zero bubble, forward only), and the evaluation program. No framework."""

from __future__ import annotations

from collections import deque
from functools import lru_cache

from .actions import (
    Action,
    B,
    Backward,
    F,
    I,
    Plan,
    PlanFn,
    ScheduleError,
    Style,
    W,
    _check,
    _one_stage_per_rank,
    stage_rank,
)
from .checking import check_plans
from .lowering import Step, lower


# ---------------------------------------------------------------------------------- GPipe
def gpipe_plan(n_stages: int, n_microbatches: int, rank: int,
               n_ranks: int | None = None) -> Plan:
    """All forwards, then all backwards (in the same microbatch order)."""
    n_ranks = _check(n_stages, n_microbatches, rank, n_ranks)
    _one_stage_per_rank("GPipe", n_stages, n_ranks)
    return ([F(mb, rank) for mb in range(n_microbatches)]
            + [B(mb, rank) for mb in range(n_microbatches)])


# ---------------------------------------------------------------------------------- 1F1B
def one_f_one_b_plan(n_stages: int, n_microbatches: int, rank: int,
                     n_ranks: int | None = None) -> Plan:
    """1F1B (PipeDream-flush): ``n_stages - rank - 1`` warm-up forwards, then alternate one
    forward and one backward, then drain the backwards. At most ``n_stages - rank`` microbatches
    are in flight on a rank (GPipe holds all of them)."""
    n_ranks = _check(n_stages, n_microbatches, rank, n_ranks)
    _one_stage_per_rank("1F1B", n_stages, n_ranks)
    m = n_microbatches
    warmup = min(n_stages - rank - 1, m)
    plan: Plan = [F(mb, rank) for mb in range(warmup)]
    for i in range(m - warmup):
        plan += [F(warmup + i, rank), B(i, rank)]
    plan += [B(i, rank) for i in range(m - warmup, m)]
    return plan


# ---------------------------------------------------------------------------------- interleaved
def interleaved_1f1b_plan(n_stages: int, n_microbatches: int, rank: int,
                          n_ranks: int | None = None) -> Plan:
    """Interleaved 1F1B (Megatron-LM): each rank holds ``v = n_stages / n_ranks`` stages
    (``rank, rank + n_ranks, ...``). Microbatches go through the virtual stages in rounds of
    ``n_ranks`` microbatches, so ``n_microbatches`` must be a multiple of ``n_ranks`` -- or below
    ``2 * n_ranks``, in which case all microbatches form one round. The bubble shrinks by
    about ``v``."""
    p = _check(n_stages, n_microbatches, rank, n_ranks)
    v, m = n_stages // p, n_microbatches
    if m >= 2 * p and m % p:
        raise ValueError(
            f"interleaved 1F1B on {p} ranks needs n_microbatches < {2 * p} or a multiple of "
            f"{p}; got {m}. Try {m - m % p} or {m - m % p + p}"
        )
    per_round = m if m < 2 * p else p
    total = m * v

    def fwd(k: int) -> Action:
        chunk = (k // per_round) % v
        mb = (k // (per_round * v)) * per_round + k % per_round
        return F(mb, rank + chunk * p)

    def bwd(k: int) -> Action:
        chunk = v - 1 - (k // per_round) % v
        mb = (k // (per_round * v)) * per_round + k % per_round
        return B(mb, rank + chunk * p)

    warmup = min((v - 1) * per_round + 2 * (p - 1 - rank), total)
    plan: Plan = [fwd(k) for k in range(warmup)]
    for k in range(total - warmup):
        plan += [fwd(warmup + k), bwd(k)]
    plan += [bwd(k) for k in range(total - warmup, total)]
    return plan


# ---------------------------------------------------------------------------------- zero bubble
@lru_cache(maxsize=256)
def _zero_bubble_all(p: int, m: int) -> tuple[tuple[Action, ...], ...]:
    """ZB-H1-style plans for every rank, by list scheduling with unit costs F = I = W = 1:
    whenever a rank is idle it runs an input-gradient (I) if one is ready, else a forward if
    fewer than ``p - rank`` microbatches await their I (1F1B's warm-up depth), else a deferred
    weight-gradient (W). Deferred W's fill what would be the 1F1B bubble; with unit costs the
    step takes ``3m + p - 1`` units against 1F1B's ``3m + 3(p - 1)`` (ZB-H1)."""
    done_f = [[-1.0] * m for _ in range(p)]   # finish time of F(mb) on stage s
    done_i = [[-1.0] * m for _ in range(p)]
    next_f = [0] * p
    pending_w: list[deque[int]] = [deque() for _ in range(p)]
    n_w = [0] * p
    n_i = [0] * p
    i_ready: list[list[tuple[float, int]]] = [[] for _ in range(p)]
    clock = [0.0] * p
    plans: list[list[Action]] = [[] for _ in range(p)]
    while any(n_w[s] < m for s in range(p)):
        # pick the rank that can start something earliest; ties -> lower rank
        best = None
        for s in range(p):
            if n_w[s] == m:
                continue
            options = []
            if i_ready[s]:   # (ready time, mb) of input-gradients whose inputs exist
                ready, mb = min(i_ready[s])
                options.append((max(clock[s], ready), 0, mb, "I"))
            mb = next_f[s]
            in_flight = next_f[s] - n_i[s]     # forwards whose input gradient is pending
            if mb < m and in_flight < p - s:
                ready = 0.0 if s == 0 else done_f[s - 1][mb]
                if ready >= 0:
                    options.append((max(clock[s], ready), 1, mb, "F"))
            if pending_w[s]:
                options.append((clock[s], 2, pending_w[s][0], "W"))
            if not options:
                continue
            start, prio, mb, kind = min(options)
            cand = (start, prio, s, mb, kind)
            if best is None or cand[:3] < best[:3]:
                best = cand
        assert best is not None, "zero-bubble list scheduling stalled"
        start, _, s, mb, kind = best
        end = start + 1.0
        clock[s] = end
        if kind == "F":
            done_f[s][mb] = end
            next_f[s] += 1
            if s == p - 1:
                i_ready[s].append((end, mb))
            plans[s].append(F(mb, s))
        elif kind == "I":
            done_i[s][mb] = end
            n_i[s] += 1
            i_ready[s].remove(min(i_ready[s]))
            if s > 0:
                i_ready[s - 1].append((end, mb))
            pending_w[s].append(mb)
            plans[s].append(I(mb, s))
        else:
            pending_w[s].popleft()
            n_w[s] += 1
            plans[s].append(W(mb, s))
    return tuple(tuple(plan) for plan in plans)


def zero_bubble_plan(n_stages: int, n_microbatches: int, rank: int,
                     n_ranks: int | None = None) -> Plan:
    """Zero-bubble (ZB-H1 style): the backward is split into ``I`` (input gradient, on the
    critical path, sent upstream at once) and ``W`` (weight gradient, deferred to fill idle
    time). Same activation budget as 1F1B; the bubble drops from about ``(p-1)(F+B)`` to about
    ``(p-1)(F+I-W)``."""
    n_ranks = _check(n_stages, n_microbatches, rank, n_ranks)
    _one_stage_per_rank("zero-bubble", n_stages, n_ranks)
    return list(_zero_bubble_all(n_stages, n_microbatches)[rank])


@lru_cache(maxsize=256)
def _split_backward_all(n_stages: int, m: int, p: int, style: Style,
                        in_flight: tuple[int, ...]) -> tuple[tuple[Action, ...], ...]:
    """Split-backward plans for several stages per rank, by list scheduling with unit costs
    F = I = W = 1 (the zero-bubble papers' model): whenever a rank can start something it runs
    an input gradient (I) if one is ready, else a forward if fewer than ``in_flight[rank]``
    microbatches await their I on the rank, else a deferred weight gradient (W); among ready
    stages the later one goes first, so microbatches reach the loss and come back sooner.
    Stages are placed by ``style`` (:func:`stage_rank`)."""
    last = n_stages - 1
    home = [stage_rank(s, n_stages, p, style) for s in range(n_stages)]
    local = [[s for s in range(n_stages) if home[s] == r] for r in range(p)]
    done_f: dict[tuple[int, int], float] = {}
    done_i: dict[tuple[int, int], float] = {}
    next_f, next_i = [0] * n_stages, [0] * n_stages
    pending_w: list[deque[tuple[int, int]]] = [deque() for _ in range(p)]
    waiting = [0] * p              # forwards on the rank whose I has not run
    n_done = [0] * p
    clock = [0.0] * p
    plans: list[list[Action]] = [[] for _ in range(p)]
    while any(n_done[r] < 3 * m * len(local[r]) for r in range(p)):
        best = None
        for r in range(p):
            options = []
            for s in reversed(local[r]):
                mb = next_i[s]
                if mb < next_f[s]:
                    deps = [done_f.get((mb, s))]
                    if s < last:
                        deps.append(done_i.get((mb, s + 1)))
                    if all(d is not None for d in deps):
                        options.append((max([clock[r]] + deps), 0, -s, mb, "I"))
                mb = next_f[s]
                if mb < m and waiting[r] < in_flight[r]:
                    dep = 0.0 if s == 0 else done_f.get((mb, s - 1))
                    if dep is not None:
                        options.append((max(clock[r], dep), 1, -s, mb, "F"))
            if pending_w[r]:
                mb, s = pending_w[r][0]
                options.append((clock[r], 2, -s, mb, "W"))
            if options:
                cand = min(options)
                if best is None or (cand[0], cand[1], r) < (best[1][0], best[1][1], best[0]):
                    best = (r, cand)
        if best is None:   # every rank waits on a forward its in-flight limit forbids
            raise ScheduleError(f"split-backward plan for {n_stages} stages, {m} microbatches "
                                f"on {p} ranks stalls with in-flight limits {in_flight}")
        r, (start, _, neg_s, mb, kind) = best
        s = -neg_s
        clock[r] = start + 1.0
        n_done[r] += 1
        if kind == "F":
            done_f[(mb, s)] = clock[r]
            next_f[s] += 1
            waiting[r] += 1
            plans[r].append(F(mb, s))
        elif kind == "I":
            done_i[(mb, s)] = clock[r]
            next_i[s] += 1
            waiting[r] -= 1
            pending_w[r].append((mb, s))
            plans[r].append(I(mb, s))
        else:
            pending_w[r].popleft()
            plans[r].append(W(mb, s))
    return tuple(tuple(plan) for plan in plans)


def zbv_plan(n_stages: int, n_microbatches: int, rank: int, n_ranks: int | None = None) -> Plan:
    """Zero-bubble V (ZB-V): two stages per rank placed in a V (rank ``r`` holds stages ``r``
    and ``2p - 1 - r``, :func:`stage_rank` with ``style="v"``), backward split into I and W as
    in :func:`zero_bubble_plan`. At most ``2p`` microbatch-stages await their I on a rank: the
    activation memory of 1F1B over the same model."""
    p = _check(n_stages, n_microbatches, rank, n_ranks)
    if n_stages != 2 * p:
        raise ValueError(f"ZB-V runs exactly two stages per rank; got {n_stages} stages on {p} "
                         f"ranks (give every rank 2 stages: r and {2 * p - 1} - r)")
    return list(_split_backward_all(n_stages, n_microbatches, p, "v", (2 * p,) * p)[rank])


@lru_cache(maxsize=256)
def _with_deferred_weights(plan_fn: PlanFn, n_stages: int, m: int, p: int,
                           cap: int) -> tuple[tuple[Action, ...], ...]:
    """``plan_fn``'s plans with every ``B`` split into ``I`` (in the B's place) and a ``W``
    run where the rank would otherwise wait (unit costs F = I = W = 1), or at once when more
    than ``cap`` W's are pending on the rank. W's carry no messages, so the split plans keep
    the original's send/receive order (and its fused forward-backward slots) and cannot
    deadlock where it does not."""
    fixed = [[I(a.mb, a.stage) if isinstance(a, Backward) else a
              for a in plan_fn(n_stages, m, r, p)] for r in range(p)]
    last = n_stages - 1
    done: dict[tuple[str, int, int], float] = {}
    pos, clock = [0] * p, [0.0] * p
    pending: list[deque[Action]] = [deque() for _ in range(p)]
    plans: list[list[Action]] = [[] for _ in range(p)]

    def ready(a: Action) -> float | None:
        if a.kind == "F":
            deps = [("F", a.stage - 1, a.mb)] if a.stage > 0 else []
        else:
            deps = [("F", a.stage, a.mb)] + ([("I", a.stage + 1, a.mb)] if a.stage < last
                                              else [])
        if any(d not in done for d in deps):
            return None
        return max([0.0] + [done[d] for d in deps])

    while any(pos[r] < len(fixed[r]) or pending[r] for r in range(p)):
        best = None
        for r in range(p):
            a = fixed[r][pos[r]] if pos[r] < len(fixed[r]) else None
            t = ready(a) if a is not None else None
            start = None if t is None else max(clock[r], t)
            # never between a forward and the I after it: the fused lowering (interleaved
            # 1F1B's) posts their messages together
            fits = a is None or a.kind == "F" or not plans[r] or plans[r][-1].kind != "F"
            if pending[r] and fits and (start is None or start > clock[r]
                                        or len(pending[r]) > cap):
                cand = (clock[r], 1, r, pending[r][0])
            elif start is not None:
                cand = (start, 0, r, a)
            else:
                continue
            if best is None or cand[:3] < best[:3]:
                best = cand
        if best is None:
            raise ScheduleError(f"{getattr(plan_fn, '__name__', plan_fn)}: plans wait on each "
                                f"other")
        start, is_w, r, a = best
        clock[r] = start + 1.0
        done[(a.kind, a.stage, a.mb)] = clock[r]
        plans[r].append(a)
        if is_w:
            pending[r].popleft()
        else:
            pos[r] += 1
            if a.kind == "I":
                pending[r].append(W(a.mb, a.stage))
    return tuple(tuple(plan) for plan in plans)


@lru_cache(maxsize=256)
def _interleaved_zero_bubble_all(n_stages: int, m: int, p: int) -> tuple[tuple[Action, ...], ...]:
    """The first W budget (``p`` held back, fewer, none) whose plans pass :func:`check_plans`
    under either lowering."""
    for cap in sorted({p, max(p // 2, 1), 1, 0}, reverse=True):
        plans = _with_deferred_weights(interleaved_1f1b_plan, n_stages, m, p, cap)
        for fuse in (False, True):
            try:
                check_plans(plans, n_stages, m, p, fuse=fuse)
                return plans
            except ScheduleError:
                pass
    good = [k * p for k in range(2, 5)]
    raise ScheduleError(
        f"interleaved zero-bubble: no deadlock-free split of interleaved 1F1B for {n_stages} "
        f"stages, {m} microbatches on {p} ranks; use a multiple of {p} from {2 * p} on "
        f"(e.g. {good}) or ScheduleInterleaved1F1B")


def interleaved_zero_bubble_plan(n_stages: int, n_microbatches: int, rank: int,
                                 n_ranks: int | None = None) -> Plan:
    """Interleaved zero-bubble: :func:`interleaved_1f1b_plan`'s order (same stages, same
    activation memory) with each backward split into ``I`` and a deferred ``W`` that fills the
    rank's waits; at most ``n_ranks`` W's are held back. Microbatch counts that are multiples
    of ``n_ranks`` from ``2 * n_ranks`` on always work; others where a split stays
    deadlock-free (a :class:`ScheduleError` says which to use otherwise)."""
    p = _check(n_stages, n_microbatches, rank, n_ranks)
    interleaved_1f1b_plan(n_stages, n_microbatches, rank, p)   # its argument checks
    return list(_interleaved_zero_bubble_all(n_stages, n_microbatches, p)[rank])


# ---------------------------------------------------------------------------------- inference
def forward_only_plan(n_stages: int, n_microbatches: int, rank: int,
                      n_ranks: int | None = None) -> Plan:
    """Forwards only (evaluation), in groups of ``n_ranks`` microbatches: each of the rank's
    stages runs the group, stages in order, then the next group.

    Running every microbatch through one stage before the next (stage-major) deadlocks once a
    rank holds two stages and there are more microbatches than ranks: the rank keeps sending
    its first stage's outputs while its peer waits to hand back the output meant for its
    second stage. Groups of ``n_ranks`` are the interleaved schedule's forward order.
    """
    n_ranks = _check(n_stages, n_microbatches, rank, n_ranks)
    local = range(rank, n_stages, n_ranks)
    return [F(mb, s) for first in range(0, n_microbatches, n_ranks) for s in local
            for mb in range(first, min(first + n_ranks, n_microbatches))]


def forward_only_program(n_stages: int, n_microbatches: int, rank: int,
                         n_ranks: int | None = None) -> list[Step]:
    """``rank``'s lowered program for an evaluation step (:func:`forward_only_plan`), the
    plans of every rank checked for deadlock first; both executors build their
    ``eval_batch`` from it."""
    n_ranks = n_stages if n_ranks is None else n_ranks
    plans = [forward_only_plan(n_stages, n_microbatches, r, n_ranks) for r in range(n_ranks)]
    check_plans(plans, n_stages, n_microbatches, n_ranks, forward_only=True)
    return lower(plans[rank], n_stages, n_ranks)
