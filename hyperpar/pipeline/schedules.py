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

The schedules live in modules with one job each -- :mod:`.actions` (the vocabulary and stage
placement), :mod:`.plans` (the schedules), :mod:`.lowering` (plan -> program with sends and
receives), :mod:`.checking` (deadlock replay, simulation, timelines) -- and this module keeps
every name importable from ``hyperpar.pipeline.schedules`` as before.
"""

from __future__ import annotations

from .actions import (  # noqa: F401
    Action,
    B,
    Backward,
    BackwardInput,
    BackwardWeight,
    F,
    Forward,
    I,
    Plan,
    PlanFn,
    ScheduleError,
    Style,
    W,
    _check,
    _one_stage_per_rank,
    rank_stages,
    stage_rank,
)
from .checking import (  # noqa: F401
    bubble_fraction_theory,
    check_plans,
    choose_lowering,
    simulate,
    timeline,
)
from .lowering import (  # noqa: F401
    Comm,
    Step,
    _needs,
    _produces,
    lower,
    lower_all,
    rank_program,
)
from .plans import (  # noqa: F401
    _interleaved_zero_bubble_all,
    _split_backward_all,
    _with_deferred_weights,
    _zero_bubble_all,
    forward_only_plan,
    forward_only_program,
    gpipe_plan,
    interleaved_1f1b_plan,
    interleaved_zero_bubble_plan,
    one_f_one_b_plan,
    zbv_plan,
    zero_bubble_plan,
)

__all__ = [
    "Action",
    "B",
    "Backward",
    "BackwardInput",
    "BackwardWeight",
    "Comm",
    "F",
    "Forward",
    "I",
    "Plan",
    "PlanFn",
    "ScheduleError",
    "Step",
    "Style",
    "W",
    "bubble_fraction_theory",
    "check_plans",
    "choose_lowering",
    "forward_only_plan",
    "forward_only_program",
    "gpipe_plan",
    "interleaved_1f1b_plan",
    "interleaved_zero_bubble_plan",
    "lower",
    "lower_all",
    "one_f_one_b_plan",
    "rank_program",
    "rank_stages",
    "simulate",
    "stage_rank",
    "timeline",
    "zbv_plan",
    "zero_bubble_plan",
]
