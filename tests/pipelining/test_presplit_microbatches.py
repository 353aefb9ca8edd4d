"""torch 2.14's pre-split schedule inputs (``arg_mbs``/``kwarg_mbs``/``target_mbs``),
``loss_kwargs`` and ``PipelineStage(get_mesh=)`` -- what torchtitan 0.3.0's trainer passes --
against plain torch in one process (a world of one)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from pipelining_cases import build_model

from hyperpar.pipelining import PipelineStage, Schedule1F1B
from hyperpar.platform import get_platform


@pytest.fixture(autouse=True)
def _leave_no_process_group() -> Iterator[None]:
    platform = get_platform()
    had_group = platform.is_initialized()
    yield
    if not had_group and platform.is_initialized():
        platform.destroy_process_group()


def _loss(out: torch.Tensor, target: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
    return ((out - target) ** 2).sum() * scale


def test_presplit_uneven_microbatches_and_loss_kwargs_match_plain_torch():
    torch.manual_seed(0)
    model, ref = build_model(2), build_model(2)
    stage = PipelineStage(model, 0, 1, None, get_mesh=lambda *a: None)
    sched = Schedule1F1B(stage, 2, loss_fn=_loss, scale_grads=False)
    xs = [torch.randn(3, 8), torch.randn(5, 8)]  # sizes a whole-batch split never makes
    ys = [torch.randn(3, 8), torch.randn(5, 8)]
    losses: list[torch.Tensor] = []
    out = sched.step(arg_mbs=[(x,) for x in xs], kwarg_mbs=[{}, {}], target_mbs=ys,
                     losses=losses, loss_kwargs={"scale": 0.25}, return_outputs=False)
    assert out is None
    mb = [_loss(ref(x), y, scale=0.25) for x, y in zip(xs, ys, strict=True)]
    sum(mb).backward()
    torch.testing.assert_close(torch.stack(losses), torch.stack(mb).detach(), rtol=1e-6,
                               atol=1e-6)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    assert stage.get_mesh is not None


def test_presplit_misuse_raises_naming_the_fix():
    sched = Schedule1F1B(PipelineStage(build_model(1), 0, 1, None), 2, loss_fn=_loss)
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="either the whole batch .* or pre-split"):
        sched.step(x, arg_mbs=[(x,), (x,)], target_mbs=[x, x])
    with pytest.raises(ValueError, match=r"arg_mbs must be a list of one entry per microbatch "
                                         r"\(2\), got list of length 3"):
        sched.step(arg_mbs=[(x,)] * 3, target_mbs=[x, x])
