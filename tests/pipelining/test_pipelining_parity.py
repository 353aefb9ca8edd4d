"""hyperpar.pipelining equals torch.distributed.pipelining and one plain-torch process: the same
script (imports changed only), losses and every parameter after 2 SGD steps."""

from __future__ import annotations

import pytest
import torch
from pipelining_cases import both, reference

# fp32 sums over a few microbatches in a different order than one process: ~1e-6 relative
# per operation, a few steps deep.
TOL = {"rtol": 1e-5, "atol": 1e-6}
LIBS = ("torch.distributed.pipelining", "hyperpar.pipelining")


def _check(results: list[dict], ref: dict, n_stages: int) -> None:
    params: dict[str, dict[str, torch.Tensor]] = {lib: {} for lib in LIBS}
    for r in results:
        for lib in LIBS:
            params[lib].update(r[lib]["params"])
    last = [r for r in results if r[LIBS[0]]["losses"]]
    assert len(last) == 1
    assert sorted(params[LIBS[1]]) == sorted(ref["params"]), "every parameter came back"
    for lib in LIBS:
        for k, v in ref["params"].items():
            torch.testing.assert_close(params[lib][k], v, **TOL, msg=f"{lib} {k}")
        got = torch.tensor(last[0][lib]["losses"])
        torch.testing.assert_close(got, torch.tensor(ref["losses"]), **TOL, msg=lib)
        if last[0][lib]["eval"] is None:   # torch's eval() is broken for this schedule
            assert lib == LIBS[0], "hyperpar's eval must always run"
            continue
        torch.testing.assert_close(last[0][lib]["eval"], ref["eval"], **TOL, msg=lib)
        torch.testing.assert_close(torch.tensor(last[0][lib]["eval_losses"]),
                                   torch.tensor(ref["eval_losses"]), **TOL, msg=lib)
    # the parameters really moved: a schedule that skipped backward would fail above, too
    start = reference(n_stages, 1, 0)["params"]
    assert any(not torch.allclose(start[k], ref["params"][k]) for k in start)


@pytest.mark.parametrize("schedule, m", [("ScheduleGPipe", 4), ("Schedule1F1B", 4),
                                         ("Schedule1F1B", 2)])
def test_two_ranks_match_torch_and_one_process(run_on_ranks, schedule, m):
    results = run_on_ranks(2, both, schedule, m, 2, timeout_s=60)
    _check(results, reference(2, m, 2), 2)


@pytest.mark.parametrize("m", [2, 4])
def test_two_ranks_two_virtual_stages_interleaved(run_on_ranks, m):
    results = run_on_ranks(2, both, "ScheduleInterleaved1F1B", m, 2, 2, timeout_s=60)
    _check(results, reference(4, m, 2), 4)


@pytest.mark.parametrize("schedule", ["ScheduleZBVZeroBubble", "ScheduleInterleavedZeroBubble"])
def test_two_ranks_zero_bubble_split_backward(run_on_ranks, schedule):
    """Input and weight gradients computed apart (I, then W later) give torch's result."""
    results = run_on_ranks(2, both, schedule, 4, 2, 2, timeout_s=60)
    _check(results, reference(4, 4, 2), 4)


def test_four_ranks_interleaved_two_stages_per_rank(run_on_ranks):
    results = run_on_ranks(4, both, "ScheduleInterleaved1F1B", 4, 2, 2, timeout_s=90)
    _check(results, reference(8, 4, 2), 8)


def test_scale_grads_false_sums_microbatch_gradients(run_on_ranks):
    results = run_on_ranks(2, both, "Schedule1F1B", 4, 2, 1, False, "sum", timeout_s=60)
    ref = reference(2, 4, 2, scale_grads=False, loss="sum")
    _check(results, ref, 2)
    # and it differs from the averaged run: the flag is not ignored
    mean_ref = reference(2, 4, 2, scale_grads=True, loss="sum")
    assert not torch.allclose(mean_ref["params"]["0.0.weight"], ref["params"]["0.0.weight"])
