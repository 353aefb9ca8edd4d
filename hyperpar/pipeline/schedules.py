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


def _needs(action: Action, n_stages: int, n_ranks: int) -> list[Comm]:
    s = action.stage
    if isinstance(action, Forward) and s > 0 and (s - 1) % n_ranks != s % n_ranks:
        return [Comm("recv", "act", action.mb, s - 1, (s - 1) % n_ranks)]
    if isinstance(action, Backward | BackwardInput) and s < n_stages - 1 \
            and (s + 1) % n_ranks != s % n_ranks:
        return [Comm("recv", "grad", action.mb, s + 1, (s + 1) % n_ranks)]
    return []


def _produces(action: Action, n_stages: int, n_ranks: int) -> list[Comm]:
    s = action.stage
    if isinstance(action, Forward) and s < n_stages - 1 and (s + 1) % n_ranks != s % n_ranks:
        return [Comm("send", "act", action.mb, s, (s + 1) % n_ranks)]
    if isinstance(action, Backward | BackwardInput) and s > 0 \
            and (s - 1) % n_ranks != s % n_ranks:
        return [Comm("send", "grad", action.mb, s, (s - 1) % n_ranks)]
    return []


def lower(plan: Sequence[Action], n_stages: int, n_ranks: int | None = None, *,
          fuse: bool = False) -> list[Step]:
    """The program the executor runs. Actions are grouped into slots (one action each; with
    ``fuse``, a forward directly followed by a backward forms one slot, as in Megatron-LM's
    steady state). Before each slot, one batch holds the sends of the previous slot and the
    receives of this slot; a final batch flushes the last sends."""
    n_ranks = n_stages if n_ranks is None else n_ranks
    slots: list[list[Action]] = []
    i = 0
    while i < len(plan):
        if fuse and i + 1 < len(plan) and isinstance(plan[i], Forward) \
                and isinstance(plan[i + 1], Backward | BackwardInput):
            slots.append([plan[i], plan[i + 1]])
            i += 2
        else:
            slots.append([plan[i]])
            i += 1
    steps: list[Step] = []
    pending: list[Comm] = []
    for slot in slots:
        recvs = [c for a in slot for c in _needs(a, n_stages, n_ranks)]
        steps.append(Step(tuple(pending + recvs), slot[0]))
        steps += [Step((), a) for a in slot[1:]]
        pending = [c for a in slot for c in _produces(a, n_stages, n_ranks)]
    if pending:
        steps.append(Step(tuple(pending), None))
    return steps


# ---------------------------------------------------------------------------------- checking
class ScheduleError(ValueError):
    """A plan is incomplete, out of order, mismatched between ranks, or deadlocks."""


@lru_cache(maxsize=256)
def choose_lowering(plan_fn: PlanFn, n_stages: int, n_microbatches: int, n_ranks: int) -> bool:
    """The ``fuse`` flag under which ``plan_fn``'s plans pass :func:`check_plans` (unfused
    first); raises :class:`ScheduleError` when neither does."""
    plans = [plan_fn(n_stages, n_microbatches, r, n_ranks) for r in range(n_ranks)]
    errors = []
    for fuse in (False, True):
        try:
            check_plans(plans, n_stages, n_microbatches, n_ranks, fuse=fuse)
            return fuse
        except ScheduleError as err:
            errors.append(str(err))
    raise ScheduleError(f"{getattr(plan_fn, '__name__', plan_fn)}({n_stages} stages, "
                        f"{n_microbatches} microbatches, {n_ranks} ranks) is not runnable: "
                        f"{errors[0]}")


def check_plans(plans: Sequence[Sequence[Action]], n_stages: int, n_microbatches: int,
                n_ranks: int | None = None, *, fuse: bool = False,
                forward_only: bool = False) -> None:
    """Raise :class:`ScheduleError` unless the per-rank ``plans`` form a correct step:

    * every rank runs only its own stages; every (stage, microbatch) has exactly one ``F`` and
      either one ``B`` or one ``I`` and one ``W`` (none with ``forward_only``), in dependency
      order on its rank;
    * replaying the lowered programs with rendezvous semantics finishes (no deadlock) and every
      channel's k-th send matches its k-th receive.
    """
    n_ranks = len(plans) if n_ranks is None else n_ranks
    if len(plans) != n_ranks:
        raise ScheduleError(f"got {len(plans)} plans for {n_ranks} ranks")
    for r, plan in enumerate(plans):
        seen: dict[tuple[str, int, int], int] = {}
        for pos, a in enumerate(plan):
            if a.stage % n_ranks != r or not 0 <= a.stage < n_stages:
                raise ScheduleError(f"rank {r} runs {a}, which belongs to rank "
                                    f"{a.stage % n_ranks}")
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
            if a.kind == "F" and a.stage > 0 and (a.stage - 1) % n_ranks == r:
                need.append(("F", a.stage - 1, a.mb))
            if a.kind in "BI" and a.stage < n_stages - 1 and (a.stage + 1) % n_ranks == r:
                need.append(("B" if ("B", a.stage + 1, a.mb) in seen else "I",
                             a.stage + 1, a.mb))
            for k in need:
                if k not in seen:
                    raise ScheduleError(f"rank {r} runs {a} at position {pos} before "
                                        f"{k[0]}(mb={k[2]}, stage={k[1]})")
        for s in range(r, n_stages, n_ranks):
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
    simulate([lower(p, n_stages, n_ranks, fuse=fuse) for p in plans])


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
