"""Pipeline schedules as data.

A schedule is a pure function ``plan(n_stages, n_microbatches, rank, n_ranks=None)`` returning
the ordered list of compute actions one pipeline rank performs in one step. Stage ``s`` lives on
rank ``s % n_ranks`` (``n_ranks`` defaults to ``n_stages``; interleaved schedules give each
rank several stages). Actions are small frozen values that print as code::

    >>> one_f_one_b_plan(4, 6, rank=2)[:4]
    [F(mb=0, stage=2), F(mb=1, stage=2), B(mb=0, stage=2), F(mb=2, stage=2)]

Communication is *derived* from the compute plan by :func:`lower` (the executor and the
checker share it): before an action, the receives it needs are batched with the sends the
previous action produced. :func:`check_plans` replays every rank's lowered program with
rendezvous semantics (a batch completes only when every one of its sends and receives has been
posted by the peer, in FIFO order per channel), so a plan that passes cannot deadlock on any
collective library, NCCL included.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal


@dataclass(frozen=True)
class Action:
    """One unit of compute for microbatch ``mb`` on stage ``stage``."""

    mb: int
    stage: int
    kind = "?"

    def __repr__(self) -> str:
        return f"{self.kind}(mb={self.mb}, stage={self.stage})"


@dataclass(frozen=True, repr=False)
class Forward(Action):
    """Forward of one microbatch through one stage (the last stage also computes the loss)."""

    kind = "F"


@dataclass(frozen=True, repr=False)
class Backward(Action):
    """Full backward: input gradient and weight gradient together."""

    kind = "B"


@dataclass(frozen=True, repr=False)
class BackwardInput(Action):
    """Zero-bubble split, part 1: only the gradient w.r.t. the stage input (sent upstream)."""

    kind = "I"


@dataclass(frozen=True, repr=False)
class BackwardWeight(Action):
    """Zero-bubble split, part 2: only the weight gradients (no communication)."""

    kind = "W"


F, B, W = Forward, Backward, BackwardWeight
I = BackwardInput  # noqa: E741  -- the name the zero-bubble literature uses

Plan = list[Action]
PlanFn = Callable[..., Plan]
Style = Literal["loop", "v"]


def stage_rank(stage: int, n_stages: int, n_ranks: int, style: Style = "loop") -> int:
    """The pipeline rank holding ``stage``. ``"loop"`` (the default): stage ``s`` on rank
    ``s % n_ranks``. ``"v"`` (zero-bubble V schedules): the stages run down the ranks and back
    up, so rank ``r`` holds stages ``r`` and ``2 * n_ranks - 1 - r`` and the first and last
    stage share rank 0."""
    if style == "loop":
        return stage % n_ranks
    if style != "v":
        raise ValueError(f"unknown stage placement {style!r}; use 'loop' or 'v'")
    chunk, pos = divmod(stage, n_ranks)
    return pos if chunk % 2 == 0 else n_ranks - 1 - pos


def rank_stages(rank: int, n_stages: int, n_ranks: int, style: Style = "loop") -> list[int]:
    """The stages ``rank`` holds, in model order (see :func:`stage_rank`)."""
    return [s for s in range(n_stages) if stage_rank(s, n_stages, n_ranks, style) == rank]


def _check(n_stages: int, n_microbatches: int, rank: int, n_ranks: int | None) -> int:
    n_ranks = n_stages if n_ranks is None else n_ranks
    if n_ranks < 1 or n_stages < 1 or n_microbatches < 1:
        raise ValueError(f"need n_stages, n_ranks, n_microbatches >= 1; got {n_stages}, "
                         f"{n_ranks}, {n_microbatches}")
    if n_stages % n_ranks:
        raise ValueError(f"n_stages={n_stages} must be a multiple of n_ranks={n_ranks}")
    if not 0 <= rank < n_ranks:
        raise ValueError(f"rank {rank} outside 0..{n_ranks - 1}")
    return n_ranks


def _one_stage_per_rank(name: str, n_stages: int, n_ranks: int) -> None:
    if n_stages != n_ranks:
        raise ValueError(f"{name} runs one stage per rank; got {n_stages} stages on {n_ranks} "
                         f"ranks (use the interleaved schedule for virtual stages)")


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


# ---------------------------------------------------------------------------------- lowering
@dataclass(frozen=True)
class Comm:
    """One message of a lowered program: ``what`` is ``"act"`` (output of ``stage`` going to
    ``stage + 1``) or ``"grad"`` (input gradient of ``stage`` going to ``stage - 1``)."""

    kind: Literal["send", "recv"]
    what: Literal["act", "grad"]
    mb: int
    stage: int
    peer: int

    def __repr__(self) -> str:
        arrow = "->" if self.kind == "send" else "<-"
        return f"{self.kind}_{self.what}(mb={self.mb}, stage={self.stage}, {arrow}{self.peer})"


@dataclass(frozen=True)
class Step:
    """Batched communication ``comms`` (posted together, then waited), then ``action``."""

    comms: tuple[Comm, ...]
    action: Action | None


def _needs(action: Action, n_stages: int, n_ranks: int, style: Style = "loop") -> list[Comm]:
    s = action.stage
    here = stage_rank(s, n_stages, n_ranks, style)
    if isinstance(action, Forward) and s > 0:
        peer = stage_rank(s - 1, n_stages, n_ranks, style)
        if peer != here:
            return [Comm("recv", "act", action.mb, s - 1, peer)]
    if isinstance(action, Backward | BackwardInput) and s < n_stages - 1:
        peer = stage_rank(s + 1, n_stages, n_ranks, style)
        if peer != here:
            return [Comm("recv", "grad", action.mb, s + 1, peer)]
    return []


def _produces(action: Action, n_stages: int, n_ranks: int, style: Style = "loop") -> list[Comm]:
    s = action.stage
    here = stage_rank(s, n_stages, n_ranks, style)
    if isinstance(action, Forward) and s < n_stages - 1:
        peer = stage_rank(s + 1, n_stages, n_ranks, style)
        if peer != here:
            return [Comm("send", "act", action.mb, s, peer)]
    if isinstance(action, Backward | BackwardInput) and s > 0:
        peer = stage_rank(s - 1, n_stages, n_ranks, style)
        if peer != here:
            return [Comm("send", "grad", action.mb, s, peer)]
    return []


def lower(plan: Sequence[Action], n_stages: int, n_ranks: int | None = None, *,
          fuse: bool = False, style: Style = "loop") -> list[Step]:
    """The program the executor runs. Actions are grouped into slots (one action each; with
    ``fuse``, a forward directly followed by a backward forms one slot, as in Megatron-LM's
    steady state; a weight gradient W then joins the slot before it). Before each slot, one
    batch holds the sends of the previous slot and the receives of this slot; a final batch
    flushes the last sends."""
    n_ranks = n_stages if n_ranks is None else n_ranks
    slots: list[list[Action]] = []
    i = 0
    while i < len(plan):
        if fuse and slots and isinstance(plan[i], BackwardWeight):
            slots[-1].append(plan[i])   # no messages: the slot's sends wait for the next batch
            i += 1
        elif fuse and i + 1 < len(plan) and isinstance(plan[i], Forward) \
                and isinstance(plan[i + 1], Backward | BackwardInput):
            slots.append([plan[i], plan[i + 1]])
            i += 2
        else:
            slots.append([plan[i]])
            i += 1
    steps: list[Step] = []
    pending: list[Comm] = []
    for slot in slots:
        recvs = [c for a in slot for c in _needs(a, n_stages, n_ranks, style)]
        steps.append(Step(tuple(pending + recvs), slot[0]))
        steps += [Step((), a) for a in slot[1:]]
        pending = [c for a in slot for c in _produces(a, n_stages, n_ranks, style)]
    if pending:
        steps.append(Step(tuple(pending), None))
    return steps


def lower_all(plans: Sequence[Sequence[Action]], n_stages: int, n_ranks: int | None = None, *,
              fuse: bool = False, style: Style = "loop") -> list[list[Step]]:
    """Every rank's program (:func:`lower`), with receives posted in the order the peer sends.

    Messages between two ranks match in the order they are posted (NCCL has no tags), so when
    a rank needs a message that its peer sends after others it has not asked for yet -- a V
    placement sends activations and gradients down the same channel -- those earlier messages
    are received in the same batch, ahead of it, and wait in the inbox until their action."""
    n_ranks = len(plans) if n_ranks is None else n_ranks
    programs = [lower(plan, n_stages, n_ranks, fuse=fuse, style=style) for plan in plans]
    sent: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
    for r, prog in enumerate(programs):
        for step in prog:
            for c in step.comms:
                if c.kind == "send":
                    sent.setdefault((r, c.peer), []).append((c.what, c.mb, c.stage))
    out = []
    for r, prog in enumerate(programs):
        posted: set[tuple[int, str, int, int]] = set()
        cursor: dict[int, int] = {}
        steps = []
        for step in prog:
            comms = [c for c in step.comms if c.kind == "send"]
            for c in step.comms:
                if c.kind != "recv" or (c.peer, c.what, c.mb, c.stage) in posted:
                    continue
                order = sent.get((c.peer, r), [])
                key = (c.what, c.mb, c.stage)
                if key not in order:
                    raise ScheduleError(f"rank {r} expects {c} but rank {c.peer} never sends it")
                upto = order.index(key)
                for what, mb, stage in order[cursor.get(c.peer, 0):upto + 1]:
                    if (c.peer, what, mb, stage) not in posted:
                        posted.add((c.peer, what, mb, stage))
                        comms.append(Comm("recv", what, mb, stage, c.peer))
                cursor[c.peer] = max(cursor.get(c.peer, 0), upto + 1)
            steps.append(Step(tuple(comms), step.action))
        out.append(steps)
    return out


def rank_program(plan_fn: PlanFn, n_stages: int, n_microbatches: int, rank: int,
                 n_ranks: int, *, fuse: bool = False, style: Style = "loop") -> list[Step]:
    """``rank``'s program from :func:`lower_all` over every rank's ``plan_fn`` plan: what an
    executor runs (its receives ordered as its peers send)."""
    plans = [plan_fn(n_stages, n_microbatches, r, n_ranks) for r in range(n_ranks)]
    return lower_all(plans, n_stages, n_ranks, fuse=fuse, style=style)[rank]


# ---------------------------------------------------------------------------------- checking
class ScheduleError(ValueError):
    """A plan is incomplete, out of order, mismatched between ranks, or deadlocks."""


@lru_cache(maxsize=256)
def choose_lowering(plan_fn: PlanFn, n_stages: int, n_microbatches: int, n_ranks: int,
                    style: Style = "loop") -> bool:
    """The ``fuse`` flag under which ``plan_fn``'s plans pass :func:`check_plans` (unfused
    first); raises :class:`ScheduleError` when neither does."""
    plans = [plan_fn(n_stages, n_microbatches, r, n_ranks) for r in range(n_ranks)]
    errors = []
    for fuse in (False, True):
        try:
            check_plans(plans, n_stages, n_microbatches, n_ranks, fuse=fuse, style=style)
            return fuse
        except ScheduleError as err:
            errors.append(str(err))
    raise ScheduleError(f"{getattr(plan_fn, '__name__', plan_fn)}({n_stages} stages, "
                        f"{n_microbatches} microbatches, {n_ranks} ranks) is not runnable: "
                        f"{errors[0]}")


def check_plans(plans: Sequence[Sequence[Action]], n_stages: int, n_microbatches: int,
                n_ranks: int | None = None, *, fuse: bool = False,
                forward_only: bool = False, style: Style = "loop") -> None:
    """Raise :class:`ScheduleError` unless the per-rank ``plans`` form a correct step:

    * every rank runs only its own stages; every (stage, microbatch) has exactly one ``F`` and
      either one ``B`` or one ``I`` and one ``W`` (none with ``forward_only``), in dependency
      order on its rank (stages placed by ``style``, see :func:`stage_rank`);
    * replaying the lowered programs with rendezvous semantics finishes (no deadlock) and every
      channel's k-th send matches its k-th receive.
    """
    n_ranks = len(plans) if n_ranks is None else n_ranks
    if len(plans) != n_ranks:
        raise ScheduleError(f"got {len(plans)} plans for {n_ranks} ranks")
    def home(stage: int) -> int:
        return stage_rank(stage, n_stages, n_ranks, style)

    for r, plan in enumerate(plans):
        seen: dict[tuple[str, int, int], int] = {}
        for pos, a in enumerate(plan):
            if not 0 <= a.stage < n_stages or home(a.stage) != r:
                raise ScheduleError(f"rank {r} runs {a}, which belongs to rank "
                                    f"{home(a.stage) if 0 <= a.stage < n_stages else '?'}")
            if not 0 <= a.mb < n_microbatches:
                raise ScheduleError(f"rank {r}: {a} names a microbatch outside "
                                    f"0..{n_microbatches - 1}")
            key = (a.kind, a.stage, a.mb)
            if key in seen:
                raise ScheduleError(f"rank {r} runs {a} twice (positions {seen[key]}, {pos})")
            seen[key] = pos
            need = []
            if a.kind in "BI":
                need.append(("F", a.stage, a.mb))
            if a.kind == "W":
                need.append(("I", a.stage, a.mb))
            # local hand-offs between consecutive stages on the same rank
            if a.kind == "F" and a.stage > 0 and home(a.stage - 1) == r:
                need.append(("F", a.stage - 1, a.mb))
            if a.kind in "BI" and a.stage < n_stages - 1 and home(a.stage + 1) == r:
                need.append(("B" if ("B", a.stage + 1, a.mb) in seen else "I",
                             a.stage + 1, a.mb))
            for k in need:
                if k not in seen:
                    raise ScheduleError(f"rank {r} runs {a} at position {pos} before "
                                        f"{k[0]}(mb={k[2]}, stage={k[1]})")
        for s in rank_stages(r, n_stages, n_ranks, style):
            for mb in range(n_microbatches):
                if forward_only:
                    if ("F", s, mb) not in seen or any(k[0] != "F" for k in seen):
                        raise ScheduleError(f"rank {r}: a forward-only plan needs one F per "
                                            f"microbatch and stage and nothing else")
                    continue
                full = ("B", s, mb) in seen
                split = ("I", s, mb) in seen and ("W", s, mb) in seen
                if ("F", s, mb) not in seen or full == split:
                    raise ScheduleError(
                        f"rank {r}: microbatch {mb} on stage {s} needs exactly one F and one B "
                        f"(or one I and one W); found "
                        f"{[k for k in ('F', 'B', 'I', 'W') if (k, s, mb) in seen]}")
    simulate(lower_all(plans, n_stages, n_ranks, fuse=fuse, style=style))


def simulate(programs: Sequence[Sequence[Step]]) -> int:
    """Replay lowered programs with rendezvous semantics; return the number of rounds.

    A rank blocked at a batch can finish it once every message in it has its counterpart
    posted: the peer is at or past the batch holding the matching operation. Messages on a
    channel (src -> dst) match in FIFO order and must agree on what they carry."""
    n = len(programs)
    where: dict[tuple[int, int, str], list[tuple[int, Comm]]] = {}
    for r, prog in enumerate(programs):
        for i, step in enumerate(prog):
            for c in step.comms:
                src, dst = (r, c.peer) if c.kind == "send" else (c.peer, r)
                where.setdefault((src, dst, c.kind), []).append((i, c))
    partner: dict[tuple[int, int, int], int] = {}   # (rank, step, comm idx) -> peer step
    for (src, dst, kind), ops in where.items():
        if kind != "send":
            continue
        recvs = where.get((src, dst, "recv"), [])
        if len(recvs) != len(ops):
            raise ScheduleError(f"channel {src}->{dst}: {len(ops)} sends but {len(recvs)} "
                                f"receives")
        for (i, s), (j, rv) in zip(ops, recvs, strict=False):
            if (s.what, s.mb, s.stage) != (rv.what, rv.mb, rv.stage):
                raise ScheduleError(
                    f"channel {src}->{dst}: rank {src} sends {s} (step {i}) while rank {dst} "
                    f"expects {rv} (step {j}) -- messages would be mismatched")
            partner[(src, i, id(s))] = j
            partner[(dst, j, id(rv))] = i
    for (src, dst, kind), ops in where.items():
        if kind == "recv" and (src, dst, "send") not in where:
            raise ScheduleError(f"channel {src}->{dst}: {len(ops)} receives, no sends")
    pos = [0] * n
    rounds = 0
    while any(pos[r] < len(programs[r]) for r in range(n)):
        progressed = False
        for r in range(n):
            if pos[r] >= len(programs[r]):
                continue
            step = programs[r][pos[r]]
            if all(pos[c.peer] >= partner[(r, pos[r], id(c))] for c in step.comms):
                pos[r] += 1
                progressed = True
        rounds += 1
        if not progressed:
            blocked = "; ".join(
                f"rank {r} at {programs[r][pos[r]].comms} before {programs[r][pos[r]].action}"
                for r in range(n) if pos[r] < len(programs[r]))
            raise ScheduleError(f"deadlock: {blocked}")
    return rounds


def timeline(plans: Sequence[Sequence[Action]], n_stages: int,
             cost: Callable[[int, Action], float]) -> dict[Action, tuple[float, float]]:
    """Start and end time of every action when each rank runs its plan in order, an action
    starts once its inputs exist (previous stage's F; next stage's B or I; own I for W), and
    ``cost(rank, action)`` is its duration -- communication taken as free. The schedule's own
    bubble is ``1 - busy / (ranks x makespan)``."""
    ends: dict[tuple[str, int, int], float] = {}
    out: dict[Action, tuple[float, float]] = {}
    clock = [0.0] * len(plans)
    pos = [0] * len(plans)
    total = sum(len(p) for p in plans)
    while len(out) < total:
        progressed = False
        for r, plan in enumerate(plans):
            while pos[r] < len(plan):
                a = plan[pos[r]]
                if a.kind == "F":
                    deps = [("F", a.stage - 1, a.mb)] if a.stage > 0 else []
                elif a.kind in "BI":
                    deps = [("F", a.stage, a.mb)]
                    if a.stage < n_stages - 1:
                        nxt = [k for k in ("B", "I") if (k, a.stage + 1, a.mb) in ends]
                        deps.append((nxt[0] if nxt else "B", a.stage + 1, a.mb))
                else:
                    deps = [("I", a.stage, a.mb)]
                if any(d not in ends for d in deps):
                    break
                start = max([clock[r]] + [ends[d] for d in deps])
                clock[r] = start + cost(r, a)
                ends[(a.kind, a.stage, a.mb)] = clock[r]
                out[a] = (start, clock[r])
                pos[r] += 1
                progressed = True
        if not progressed:
            raise ScheduleError("timeline: plans wait on each other (incomplete or cyclic)")
    return out


def bubble_fraction_theory(n_ranks: int, n_microbatches: int, virtual_stages: int = 1) -> float:
    """Idle fraction of a synchronous pipeline step: ``(p - 1) / (v * m + p - 1)``."""
    p, m, v = n_ranks, n_microbatches, virtual_stages
    return (p - 1) / (v * m + p - 1)


def forward_only_program(n_stages: int, n_microbatches: int, rank: int,
                         n_ranks: int | None = None) -> list[Step]:
    """``rank``'s lowered program for an evaluation step (:func:`forward_only_plan`), the
    plans of every rank checked for deadlock first; both executors build their
    ``eval_batch`` from it."""
    n_ranks = n_stages if n_ranks is None else n_ranks
    plans = [forward_only_plan(n_stages, n_microbatches, r, n_ranks) for r in range(n_ranks)]
    check_plans(plans, n_stages, n_microbatches, n_ranks, forward_only=True)
    return lower(plans[rank], n_stages, n_ranks)
