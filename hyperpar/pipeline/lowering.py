"""Lowering a compute plan to a program: the sends and receives each action needs and
produces (:class:`Comm`), batched before the action (:class:`Step`); over all ranks at once,
receives ordered as the peers send (:func:`lower_all`). No framework."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from .actions import (
    Action,
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    PlanFn,
    ScheduleError,
    Style,
    stage_rank,
)


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
