"""Checking plans before they run: :func:`check_plans` replays every rank's lowered
program with rendezvous semantics (a plan that passes cannot deadlock), :func:`choose_lowering`,
:func:`simulate`, :func:`timeline` and the theoretical bubble. No framework."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache

from .actions import Action, PlanFn, ScheduleError, Style, rank_stages, stage_rank
from .lowering import Comm, Step, lower_all


# ---------------------------------------------------------------------------------- checking
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
