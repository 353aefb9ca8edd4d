"""MindSpore backend tests: real processes (MindSpore's scheduler + one worker per rank).

Skipped, with the reason, where MindSpore is not importable (the torch venv): run them with
``scripts/test-mindspore.sh``, which builds a cached venv with MindSpore and no torch. A pool of
ranks is started once per world size for the whole session (MindSpore's import and ``init()``
cost 10-60 s on a loaded host); each test then runs functions on it in milliseconds.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest

if importlib.util.find_spec("mindspore") is None:
    pytest.skip("mindspore is not installed in this venv; run scripts/test-mindspore.sh "
                "(a cached venv with MindSpore 2.10 and no torch)", allow_module_level=True)

from hyperpar.testing.harness import WorkerPool  # noqa: E402

# Start-up is MindSpore's import + init() on every rank at once; on 2 shared cores with 4 ranks
# that was seen to take over a minute. Collectives that fail leave MindSpore peers waiting ~30 s.
START_TIMEOUT_S = 600.0
COLLECTIVE_TIMEOUT_S = 120.0


@pytest.fixture(scope="session")
def ms_pools() -> Iterator[dict[int, WorkerPool]]:
    pools: dict[int, WorkerPool] = {}
    yield pools
    for pool in pools.values():
        pool.close()


def _pool(pools: dict[int, WorkerPool], n: int) -> WorkerPool:
    if n not in pools:
        pools[n] = WorkerPool(n, backend="mindspore", start_timeout_s=START_TIMEOUT_S,
                              collective_timeout_s=COLLECTIVE_TIMEOUT_S,
                              env={"GLOG_v": "3", "HYPERPAR_MS_DEVICE": "CPU"})
    return pools[n]


@pytest.fixture
def pool2(ms_pools: dict[int, WorkerPool]) -> WorkerPool:
    return _pool(ms_pools, 2)


@pytest.fixture
def pool4(ms_pools: dict[int, WorkerPool]) -> WorkerPool:
    return _pool(ms_pools, 4)
