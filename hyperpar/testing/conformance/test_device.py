"""Identity and device facts of the selected backend (in the test process)."""

from __future__ import annotations

import os

import pytest
import torch

from hyperpar.platform import DeviceCapacityError, backends, get_platform


def test_selected_backend_reports_itself_available():
    p = get_platform()
    info = backends()[p.name]
    assert info.availability.ok, info.availability.reason
    assert isinstance(p.device_type, str) and p.device_type
    assert isinstance(p.dist_backend, str) and p.dist_backend
    assert p.name in repr(p) and p.dist_backend in p.describe()


def test_device_count_is_positive_and_device_has_the_backend_type():
    p = get_platform()
    assert p.device_count() >= 1
    d = p.device(0)
    assert isinstance(d, torch.device)
    t = torch.ones(2, device=p.device())
    assert t.device.type == p.device().type


def test_set_device_then_current_device_round_trips():
    p = get_platform()
    last = p.device_count() - 1
    before = p.current_device()
    p.set_device(last)
    try:
        assert p.current_device() == (last if p.device_count() > 1 else 0)
    finally:
        p.set_device(before)


def test_manual_seed_makes_random_draws_repeatable():
    p = get_platform()
    p.manual_seed(123)
    a = torch.randn(5, device=p.device())
    p.manual_seed(123)
    b = torch.randn(5, device=p.device())
    torch.testing.assert_close(a, b)


def test_rng_state_snapshot_restores_the_stream():
    p = get_platform()
    state = p.get_rng_state()
    a = torch.rand(4, device=p.device())
    p.set_rng_state(state)
    torch.testing.assert_close(torch.rand(4, device=p.device()), a)


def test_memory_stats_has_allocated_counters():
    stats = get_platform().memory_stats()
    assert {"allocated", "max_allocated"} <= set(stats)
    assert all(isinstance(v, int) and v >= 0 for v in stats.values())


def test_synchronize_waits_for_queued_device_work():
    """Work queued on the device (asynchronous on accelerators), then an asynchronous copy to
    host memory: after ``synchronize()`` the host copy must hold the final values."""
    p = get_platform()
    x = torch.ones(512, 512, device=p.device())
    for _ in range(8):
        x = x @ x / 512  # sums of 512 ones, divided back: exactly 1.0 in any float format
    host = torch.empty(x.shape, dtype=x.dtype)
    try:
        host = host.pin_memory()  # a non-blocking copy into pinned memory does not wait
    except (RuntimeError, NotImplementedError, AttributeError):
        pass  # no accelerator here: the copy below is synchronous anyway
    host.copy_(x, non_blocking=True)
    assert p.synchronize() is None
    assert torch.equal(host, torch.ones(512, 512)), "synchronize() returned before the copy ended"


def test_visible_devices_variable_is_a_name_or_none():
    env = get_platform().visible_devices_env
    assert env is None or (isinstance(env, str) and env.isupper())
    if env and env in os.environ:
        assert get_platform().device_count() <= len(os.environ[env].split(","))


def test_collective_fallbacks_are_described():
    fallbacks = get_platform().collective_fallbacks()
    assert all(isinstance(k, str) and isinstance(v, str) and v for k, v in fallbacks.items())


def test_rank_capacity_matches_the_devices_and_refusal_is_clear():
    p = get_platform()
    assert isinstance(p.ranks_share_device, bool)
    limit = p.max_local_ranks()
    p.check_world_fits(1)  # world size 1 always fits
    if p.ranks_share_device:
        assert limit is None
        return
    assert limit == p.device_count()
    with pytest.raises(DeviceCapacityError) as err:
        p.check_world_fits(limit + 1)
    message = str(err.value)
    assert f"{limit + 1} ranks but {limit} {p.device_type} device" in message
    assert "one device per rank" in message and "cpu backend" in message
