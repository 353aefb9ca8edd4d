"""The vocabulary of pipeline schedules: compute actions (``F``, ``B``, ``I``, ``W``), which
rank holds which stage, the argument checks every plan shares, and :class:`ScheduleError`.
Imported by every other schedule module; imports none of them. No framework."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
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


class ScheduleError(ValueError):
    """A plan is incomplete, out of order, mismatched between ranks, or deadlocks."""
