"""A failed collective names the rank that held it up, not the rank that waited for it.

Each case runs real gloo ranks: one rank sleeps or dies before a collective its peer is in, and
the reported culprit (``DistributedError.rank`` and the text) must be that rank and the call.
"""

from __future__ import annotations

import inspect
import os
import time

import pytest
import torch

from hyperpar.platform import get_platform
from hyperpar.platform.health import call_signature
from hyperpar.testing import DistributedError, WorkerPool, run_distributed

TIMEOUT_S = 4.0  # the collective timeout of these tests: a hang fails after ~TIMEOUT_S + grace


def _rank_one_sleeps_before_the_third_collective() -> None:
    p = get_platform()
    t = torch.ones(3)
    p.all_reduce(t)
    p.barrier()
    if p.rank() == 1:
        time.sleep(120)  # e.g. a slow data loader, or a deadlock in user code
    p.all_reduce(t)


def _last_rank_dies_before_the_broadcast() -> None:
    p = get_platform()
    p.barrier()
    if p.rank() == p.world_size() - 1:
        os._exit(7)
    p.broadcast(torch.ones(2), src=0)
    time.sleep(120)  # a healthy rank that is not in a collective does not report anything


def _rank_one_gathers_a_different_shape() -> None:
    p = get_platform()
    local = torch.ones(3 if p.rank() == 0 else 5)
    out = torch.empty(2 * local.numel())
    p.all_gather_into_tensor(out, local)


def _rank_one_calls_broadcast_where_rank_zero_reduces() -> None:
    p = get_platform()
    t = torch.ones(2)
    if p.rank() == 0:
        p.all_reduce(t)
    else:
        p.broadcast(t, src=0)


def test_a_rank_that_never_reaches_a_collective_is_the_culprit():
    # The sleeping rank would take 120 s; the report must come from rank 0's collective timeout
    # (the text below), not from waiting it out -- pytest's own timeout catches a hang.
    with pytest.raises(DistributedError) as err:
        run_distributed(_rank_one_sleeps_before_the_third_collective, 2, timeout_s=TIMEOUT_S)
    assert err.value.rank == 1, str(err.value)
    text = str(err.value)
    assert "rank 1 did not reach all_reduce #3 (rank 0 waited" in text, text


def test_a_rank_that_died_before_a_collective_is_the_culprit_on_four_ranks():
    with pytest.raises(DistributedError) as err:
        run_distributed(_last_rank_dies_before_the_broadcast, 4, timeout_s=TIMEOUT_S)
    assert err.value.rank == 3, str(err.value)
    assert "rank 3" in str(err.value).splitlines()[0], str(err.value)


def test_debug_mode_names_the_mismatching_call_and_shapes_on_every_rank():
    env = {"HYPERPAR_DEBUG_COLLECTIVES": "1"}
    with WorkerPool(2, collective_timeout_s=30, env=env) as pool:
        with pytest.raises(DistributedError) as err:
            pool.run(_rank_one_gathers_a_different_shape, timeout_s=60)
    text = str(err.value)
    assert "CollectiveMismatchError: collective #1 of group [0, 1] differs across ranks" in text
    assert "rank 0: all_gather_into_tensor(output=float32[6], input=float32[3])" in text
    assert "rank 1: all_gather_into_tensor(output=float32[10], input=float32[5])" in text


def test_debug_mode_names_ranks_that_issue_different_collectives():
    env = {"HYPERPAR_DEBUG_COLLECTIVES": "1"}
    with WorkerPool(2, collective_timeout_s=30, env=env) as pool:
        with pytest.raises(DistributedError) as err:
            pool.run(_rank_one_calls_broadcast_where_rank_zero_reduces, timeout_s=60)
    text = str(err.value)
    assert "rank 0: all_reduce(tensor=float32[2])" in text, text
    assert "rank 1: broadcast(tensor=float32[2], src=0)" in text, text


def test_call_signature_leaves_out_what_may_differ_per_rank():
    def all_to_all_single(self, output, input, output_split_sizes=None,
                          input_split_sizes=None, group=None, async_op=False):
        """Signature only."""

    sig = inspect.signature(all_to_all_single)
    text = call_signature("all_to_all_single", sig,
                          (torch.empty(5), torch.empty(3, dtype=torch.bfloat16), [2, 3], [1, 2]),
                          {"async_op": True})
    assert text == "all_to_all_single(output=float32, input=bfloat16)"


def test_without_debug_mode_a_mismatch_abort_points_to_debug_mode():
    """gloo aborts the process on mismatched sizes (no Python exception to catch): the report
    names the aborted rank and says how to find the call."""
    with pytest.raises(DistributedError) as err:
        run_distributed(_rank_one_gathers_a_different_shape, 2, timeout_s=TIMEOUT_S)
    assert "HYPERPAR_DEBUG_COLLECTIVES=1" in str(err.value), str(err.value)
