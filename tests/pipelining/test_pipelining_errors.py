"""Bad input raises a clear error on every rank before any transfer; a stage that raises is
named on every rank within the collective timeout (no hang)."""

from __future__ import annotations

import pytest
import torch
from pipelining_cases import build_model, mse_mean
from torch import nn

from hyperpar.platform import get_platform
from hyperpar.testing import WorkerPool

TIMEOUT_S = 8.0                 # collective timeout: the waiting rank gives up after it
RUN_TIMEOUT_S = TIMEOUT_S + 30.0  # headroom for error handling on 2 loaded cores


class Boom(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("boom in the second stage")


def _message(fn) -> str:
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _bad_inputs() -> dict[str, str]:
    import hyperpar.pipelining as pp

    platform = get_platform()
    rank, world = platform.rank(), platform.world_size()
    model = build_model(world)
    wrong = pp.PipelineStage(model[(rank + 1) % world], (rank + 1) % world, world,
                             platform.device())
    out = {"wrong rank": _message(lambda: pp.Schedule1F1B(wrong, 4, mse_mean))}
    stage = pp.PipelineStage(model[rank], rank, world, platform.device())
    out["zbv one stage"] = _message(lambda: pp.ScheduleZBVZeroBubble([stage], 4, mse_mean))
    v_model = build_model(2 * world)   # loop placement handed to the V schedule
    loop = [pp.PipelineStage(v_model[i], i, 2 * world, platform.device())
            for i in (rank, rank + world)]
    out["zbv loop placement"] = _message(lambda: pp.ScheduleZBVZeroBubble(loop, 4, mse_mean))
    out["dual pipe"] = _message(lambda: pp.ScheduleDualPipeV(loop, 4, mse_mean))
    out["looped bfs"] = _message(lambda: pp.ScheduleLoopedBFS([stage], 4, mse_mean))
    out["two stages to a single schedule"] = _message(
        lambda: pp.ScheduleInterleaved1F1B([stage, stage], 4, mse_mean))
    out["merge spec"] = _message(lambda: pp.Schedule1F1B(stage, 4, mse_mean,
                                                         output_merge_spec={"x": 0}))
    sched = pp.Schedule1F1B(stage, 4, mse_mean)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    with torch.no_grad():
        out["no_grad"] = _message(lambda: sched.step(x, target=y))
    return out


def test_bad_input_is_named_on_every_rank(run_on_ranks):
    for got in run_on_ranks(2, _bad_inputs, timeout_s=60):
        assert got["wrong rank"].startswith("ValueError: Schedule1F1B: pipeline rank ")
        assert "build those PipelineStages on this rank" in got["wrong rank"]
        assert got["zbv one stage"].startswith("ValueError: ZB-V runs exactly two stages per rank")
        assert "V placement: rank r holds stages r and 2p - 1 - r" in got["zbv loop placement"]
        assert got["dual pipe"].startswith(
            "NotImplementedError: hyperpar.pipelining.ScheduleDualPipeV is not implemented")
        assert "deadlocks under rendezvous sends" in got["looped bfs"]
        assert "duplicate stage indices" in got["two stages to a single schedule"] or \
            "make 4 stages" in got["two stages to a single schedule"]
        assert got["merge spec"].startswith("NotImplementedError: Schedule1F1B: "
                                            "output_merge_spec is not supported")
        assert got["no_grad"].startswith("RuntimeError: Schedule1F1B.step() needs gradients")


def _failing(case: str) -> str:
    import hyperpar.pipelining as pp

    platform = get_platform()
    rank, world = platform.rank(), platform.world_size()
    model = build_model(world)
    if case == "raises":
        model[1] = Boom()
    stage = pp.PipelineStage(model[rank], rank, world, platform.device())
    sched = pp.Schedule1F1B(stage, 2, mse_mean)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    target = None if case == "no_target" else y
    return _message(lambda: sched.step(x, target=target))


@pytest.mark.parametrize("case, cause", [
    ("raises", "ValueError: boom in the second stage"),
    ("no_target", "ValueError: step(): no target on the rank holding the last stage (1)"),
], ids=["stage-raises", "no-target"])
def test_a_failing_stage_is_named_on_every_rank(case, cause):
    with WorkerPool(2, collective_timeout_s=TIMEOUT_S) as pool:
        messages = pool.run(_failing, case, timeout_s=RUN_TIMEOUT_S)
    assert messages[1].startswith(cause), messages[1]
    assert messages[0].startswith(f"PipelineStageError: stage 1 (rank 1) failed: {cause}"), \
        messages[0]


@pytest.mark.parametrize("kwargs", [{"backward_requires_autograd": False},
                                    {"defer_pp_recv": True}])
def test_torch_keywords_beyond_their_defaults_are_refused_by_name(kwargs):
    # torchtitan passes backward_requires_autograd=True (torch's default): accepted; other
    # values name the keyword and the fix before any stage is looked at
    from hyperpar.pipelining import ScheduleInterleaved1F1B

    (name,) = kwargs
    with pytest.raises(NotImplementedError, match=name):
        ScheduleInterleaved1F1B([], n_microbatches=2, **kwargs)
