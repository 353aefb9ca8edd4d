"""One process (a world of one, joined as init_device_mesh does): a one-stage pipeline equals
plain torch, and declared input/output shapes are checked against the real ones."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from pipelining_cases import build_model, mse_mean

from hyperpar.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from hyperpar.platform import get_platform


@pytest.fixture(autouse=True)
def _leave_no_process_group() -> Iterator[None]:
    platform = get_platform()
    had_group = platform.is_initialized()
    yield
    if not had_group and platform.is_initialized():
        platform.destroy_process_group()


def test_one_stage_matches_plain_torch_and_eval_has_no_grad():
    model, ref = build_model(2), build_model(2)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    sched = ScheduleGPipe(PipelineStage(model, 0, 1, None), 4, loss_fn=mse_mean)
    losses: list[torch.Tensor] = []
    out = sched.step(x, target=y, losses=losses)
    mb = [mse_mean(ref(a), b) for a, b in zip(x.tensor_split(4), y.tensor_split(4), strict=True)]
    (sum(mb) / 4).backward()
    torch.testing.assert_close(out, ref(x).detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(torch.stack(losses), torch.stack(mb).detach(), rtol=1e-6,
                               atol=1e-7)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)
    grads = [p.grad.clone() for p in model.parameters()]
    out = sched.eval(x)
    assert not out.requires_grad
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))


def test_declared_shapes_are_checked():
    stage = PipelineStage(build_model(1), 0, 1, None, output_args=torch.empty(3, 8))
    sched = Schedule1F1B(stage, 2, loss_fn=mse_mean)
    with pytest.raises(ValueError, match=r"stage 0: the output has shapes \[\(4, 8\)\] but "
                                         r"output_args declared \[\(3, 8\)\]"):
        sched.step(torch.randn(8, 8), target=torch.randn(8, 8))
