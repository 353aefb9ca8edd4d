"""Schedule plans are pure data: complete, ordered, and deadlock-free (no processes)."""

from __future__ import annotations

import pytest

from hyperpar.pipeline import (
    B,
    F,
    ScheduleError,
    bubble_fraction_theory,
    check_plans,
    gpipe_plan,
    interleaved_1f1b_plan,
    lower,
    lower_all,
    one_f_one_b_plan,
    simulate,
    timeline,
    zero_bubble_plan,
)
from hyperpar.pipeline.schedules import I, W, choose_lowering

FLAT = [gpipe_plan, one_f_one_b_plan, zero_bubble_plan]


def test_actions_are_frozen_values_that_print_as_code():
    assert repr(F(mb=2, stage=1)) == "F(mb=2, stage=1)"
    assert repr(I(0, 3)) == "I(mb=0, stage=3)" and repr(W(0, 3)) == "W(mb=0, stage=3)"
    assert F(2, 1) == F(2, 1) and F(2, 1) != B(2, 1)
    assert len({F(2, 1), F(2, 1), B(2, 1)}) == 2
    with pytest.raises(AttributeError):
        F(2, 1).mb = 3


def test_one_f_one_b_warms_up_then_alternates():
    assert one_f_one_b_plan(4, 6, rank=2) == [
        F(0, 2), F(1, 2), B(0, 2), F(2, 2), B(1, 2), F(3, 2), B(2, 2), F(4, 2), B(3, 2),
        F(5, 2), B(4, 2), B(5, 2)]
    assert one_f_one_b_plan(4, 2, rank=0) == [F(0, 0), F(1, 0), B(0, 0), B(1, 0)]


def test_gpipe_runs_all_forwards_first():
    assert gpipe_plan(2, 3, 1) == [F(0, 1), F(1, 1), F(2, 1), B(0, 1), B(1, 1), B(2, 1)]


@pytest.mark.parametrize("plan_fn", FLAT, ids=lambda f: f.__name__)
@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 8])
def test_flat_schedules_are_complete_and_deadlock_free(plan_fn, p):
    for m in range(1, 2 * p + 3):
        check_plans([plan_fn(p, m, r) for r in range(p)], p, m)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("v", [2, 3])
def test_interleaved_is_complete_and_deadlock_free(p, v):
    for m in [*range(1, 2 * p), 2 * p, 3 * p, 4 * p]:
        fuse = choose_lowering(interleaved_1f1b_plan, p * v, m, p)
        check_plans([interleaved_1f1b_plan(p * v, m, r, p) for r in range(p)], p * v, m, p,
                    fuse=fuse)


def test_interleaved_rejects_uneven_rounds_with_a_suggestion():
    with pytest.raises(ValueError, match="multiple of 4.*Try 8 or 12"):
        interleaved_1f1b_plan(8, 10, 0, 4)


def test_every_microbatch_has_one_forward_and_one_backward_per_stage():
    plans = [zero_bubble_plan(4, 5, r) for r in range(4)]
    for r, plan in enumerate(plans):
        for mb in range(5):
            kinds = sorted(a.kind for a in plan if a.mb == mb and a.stage == r)
            assert kinds == ["F", "I", "W"]
        assert all(isinstance(a, F | I | W) for a in plan)


def test_checker_reports_a_missing_backward():
    plans = [one_f_one_b_plan(2, 3, r) for r in range(2)]
    plans[1] = plans[1][:-1]
    with pytest.raises(ScheduleError, match="exactly one F and one B"):
        check_plans(plans, 2, 3)


def test_checker_reports_backward_before_forward():
    plans = [one_f_one_b_plan(2, 2, r) for r in range(2)]
    plans[0] = [B(0, 0), *[a for a in plans[0] if a != B(0, 0)]]
    with pytest.raises(ScheduleError, match="before F"):
        check_plans(plans, 2, 2)


def test_checker_finds_a_deadlock():
    # both ranks wait for the other's forward output first
    plans = [[F(0, 0), B(0, 0)], [B(0, 1), F(0, 1)]]
    with pytest.raises(ScheduleError):
        check_plans(plans, 2, 1)


def test_receives_are_posted_in_the_senders_order():
    plans = [gpipe_plan(2, 2, 0), gpipe_plan(2, 2, 1)]
    plans[1] = [F(1, 1), F(0, 1), B(0, 1), B(1, 1)]
    # lowered one rank at a time, rank 1 would ask for microbatch 1 first: mismatched
    with pytest.raises(ScheduleError, match="mismatched"):
        simulate([lower(p, 2) for p in plans])
    # lower_all posts microbatch 0's receive ahead of it (it waits in the inbox)
    first = lower_all(plans, 2)[1][0]
    assert [(c.kind, c.what, c.mb) for c in first.comms] == [("recv", "act", 0),
                                                             ("recv", "act", 1)]
    check_plans(plans, 2, 2)


def test_lowering_batches_sends_of_one_action_with_receives_of_the_next():
    steps = lower(one_f_one_b_plan(2, 2, 0), 2)
    assert [s.action for s in steps] == [F(0, 0), F(1, 0), B(0, 0), B(1, 0)]  # no grad to send
    kinds = [[(c.kind, c.what, c.mb) for c in s.comms] for s in steps]
    assert kinds[2] == [("send", "act", 1), ("recv", "grad", 0)]
    assert lower(one_f_one_b_plan(2, 2, 1), 2)[-1].action is None  # flushes its last send
    assert simulate([lower(one_f_one_b_plan(2, 2, r), 2) for r in range(2)]) > 0


def test_zero_bubble_defers_weight_gradients_on_early_ranks():
    plan = zero_bubble_plan(4, 8, 0)
    first_w = next(i for i, a in enumerate(plan) if a.kind == "W")
    first_i = next(i for i, a in enumerate(plan) if a.kind == "I")
    assert first_w > first_i


def _makespan(plans, n_stages, cost):
    times = timeline(plans, n_stages, lambda rank, a: cost[a.kind])
    return max(end for _, end in times.values())


def test_zero_bubble_has_a_smaller_bubble_than_1f1b_in_unit_time():
    p, m = 4, 8
    cost = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
    t_1f1b = _makespan([one_f_one_b_plan(p, m, r) for r in range(p)], p, cost)
    t_zb = _makespan([zero_bubble_plan(p, m, r) for r in range(p)], p, cost)
    ideal = 3.0 * m
    assert (t_1f1b - ideal) / t_1f1b == pytest.approx(bubble_fraction_theory(p, m))
    assert t_1f1b - ideal == 3 * (p - 1)      # (p - 1)(F + B)
    assert t_zb - ideal == p - 1              # ZB-H1: (p - 1)(F + I - W)


def test_interleaving_shrinks_the_unit_time_bubble_by_the_virtual_stage_count():
    p, m, v = 4, 8, 2
    cost = {"F": 1.0 / v, "B": 2.0 / v}
    plans = [interleaved_1f1b_plan(p * v, m, r, p) for r in range(p)]
    t = max(end for _, end in timeline(plans, p * v, lambda r, a: cost[a.kind]).values())
    ideal = 3.0 * m
    assert (t - ideal) / t == pytest.approx(bubble_fraction_theory(p, m, v))


def test_forward_only_plans_follow_the_data_flow():
    from hyperpar.pipeline import forward_only_plan

    # (2, 2, 4) and (2, 4, 7): two or more stages per rank and more microbatches than ranks --
    # stage-major forwards deadlocked there
    for p, v, m in [(2, 1, 3), (4, 2, 5), (3, 3, 1), (2, 2, 4), (2, 4, 7), (3, 2, 9)]:
        plans = [forward_only_plan(p * v, m, r, p) for r in range(p)]
        check_plans(plans, p * v, m, p, forward_only=True)
        check_plans(plans, p * v, m, p, forward_only=True, fuse=True)
    with pytest.raises(ScheduleError, match="one F per microbatch"):
        check_plans([one_f_one_b_plan(2, 2, r) for r in range(2)], 2, 2, forward_only=True)
