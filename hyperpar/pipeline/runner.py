"""The instruction loop of a pipeline step, written once for every framework.

A lowered program (:func:`hyperpar.pipeline.schedules.lower`) is a list of ``Step``: a batch of
sends and receives, then at most one compute action. :func:`run_program` replays it, timing
communication and compute; the framework's executor supplies only ``communicate(comms)`` (post
the batch and file what arrived) and ``run(action)`` (forward or backward of one microbatch on
one stage). The torch executor (:mod:`hyperpar.pipeline.executor`) and the MindSpore one
(``hyperpar_mindspore.pipeline``) both drive their steps through it. No framework is imported.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .schedules import Action, Comm, Step


@dataclass
class StepTimings:
    """Where one step's time went on this rank (seconds)."""

    step_s: float = 0.0
    compute_s: float = 0.0
    comm_s: float = 0.0
    per_action: list[tuple[Action, float]] = field(default_factory=list)

    @property
    def idle_fraction(self) -> float:
        """Share of the step not spent computing (bubble plus communication)."""
        return 1.0 - self.compute_s / self.step_s if self.step_s else 0.0


def run_program(program: Sequence[Step], communicate: Callable[[Sequence[Comm]], None],
                run: Callable[[Action], None], timings: StepTimings,
                on_action: Callable[[int | None], None] = lambda stage: None) -> None:
    """Replay ``program``: each step's comms through ``communicate``, then its action through
    ``run``. ``on_action(stage)`` is told which stage is computing (``None`` once the program
    is done), so a failure can be blamed on it; ``timings`` accumulates comm and compute time
    (``step_s`` is left to the caller, which also times its own epilogue)."""
    clock = time.perf_counter
    for step in program:
        if step.comms:
            t0 = clock()
            communicate(step.comms)
            timings.comm_s += clock() - t0
        if step.action is not None:
            t0 = clock()
            on_action(step.action.stage)
            run(step.action)
            dt = clock() - t0
            timings.compute_s += dt
            timings.per_action.append((step.action, dt))
    on_action(None)
