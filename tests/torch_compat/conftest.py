"""Shared fixtures of the torch-compatibility suite: every case of a world size runs in ONE
batch on the session's pooled ranks (start-up is paid once), and the tests read the results."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest

from hyperpar.testing import WorkerPool


@pytest.fixture(scope="module")
def run_batch(_hyperpar_pools: dict[int, WorkerPool]) -> Callable[..., list[Any]]:
    """``run_batch(world_size, fn, *args)``: like ``run_on_ranks`` but usable from module-scoped
    fixtures (the same session pools)."""
    from hyperpar.platform import get_platform

    if get_platform().name != "cpu":
        pytest.skip("the torch-compatibility suite compares with torch's DTensor on gloo (cpu)")

    def run(world_size: int, fn: Callable[..., Any], *args: Any, timeout_s: float = 600
            ) -> list[Any]:
        pool = _hyperpar_pools.get(world_size)
        if pool is None:
            pool = _hyperpar_pools[world_size] = WorkerPool(
                world_size, backend=os.environ.get("HYPERPAR_BACKEND") or None)
        return pool.run(fn, *args, timeout_s=timeout_s)

    return run
