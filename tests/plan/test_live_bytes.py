"""LiveBytes, the peak tracker behind ``--measure``'s measured peak: exact byte counts for known
allocations, views counted once, storages resized in place seen at their new size, freed
tensors leaving the count."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hyperpar.plan.live_bytes import LiveBytes  # noqa: E402


def test_counts_op_outputs_once_per_storage_and_forgets_freed_ones() -> None:
    with LiveBytes() as lb:
        a = torch.zeros(1000)                 # 4000 B
        view = a[10:20]                       # a view: no new storage
        b = torch.ones(500, dtype=torch.float64)  # 4000 B
        assert lb.current == 8000
        del b
        c = torch.zeros(250)                  # 1000 B; b is gone
        assert lb.current == 5000
    assert lb.peak == 8000
    assert view.numel() == 10 and c.numel() == 250


def test_tracked_tensors_and_in_place_resizes() -> None:
    weight = torch.zeros(100)  # exists before the mode: must be tracked by hand
    buf = torch.empty(0)
    with LiveBytes() as lb:
        lb.track([weight, None])
        assert lb.current == 400
        buf = buf + 0              # an op output: tracked, 0 bytes
        buf.untyped_storage().resize_(2000)   # what fully_shard does to unsharded params
        torch.zeros(1)             # the next op samples the resized storage
        assert lb.peak == 400 + 2000 + 4
        buf.untyped_storage().resize_(0)
        assert lb.current == 400


def test_autograd_saved_tensors_count_until_backward_frees_them() -> None:
    w = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(8, 64)
    with LiveBytes() as lb:
        lb.track([w, x])
        base = lb.current
        y = torch.tanh(x @ w)      # saves the tanh output (8x64 fp32) for backward
        loss = y.sum()
        held = lb.current - base
        loss.backward()
    assert held >= 8 * 64 * 4
    assert lb.peak >= base + held
    assert w.grad is not None and w.grad.shape == (64, 64)
