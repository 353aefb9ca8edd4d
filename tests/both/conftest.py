"""One test body, every framework: the ``framework`` fixture runs each test on torch and on
MindSpore, whichever is importable in this venv (the other case is skipped with the reason).

Ranks are real processes from hyperpar's ``WorkerPool``: torch ranks on the ``cpu`` (gloo)
backend, MindSpore ranks on the ``mindspore`` backend (its scheduler + one worker per rank). One
pool per (framework, world size) is shared by the whole session: MindSpore's import and ``init()``
cost 20-60 s per rank on a loaded host. Nothing here imports a framework.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from hyperpar.testing.harness import WorkerPool
from tests.both._frameworks import BACKENDS, available

# MindSpore start-up on 2 shared cores with 4 ranks was seen to take over a minute; a failed
# MindSpore collective leaves its peers waiting ~30 s.
START_TIMEOUT_S = 600.0
COLLECTIVE_TIMEOUT_S = 120.0
_ENV = {
    "torch": {},
    "mindspore": {"GLOG_v": "3", "HYPERPAR_MS_DEVICE": "CPU"},
}
_HOW = {
    "torch": "run the main suite in the torch venv",
    "mindspore": "run scripts/test-mindspore.sh (a cached venv with MindSpore 2.10 and no torch)",
}


@pytest.fixture(params=["torch", "mindspore"])
def framework(request: pytest.FixtureRequest) -> str:
    """The framework this case runs on; skipped where it is not importable."""
    name = request.param
    if not available(name):
        pytest.skip(f"{name} is not installed in this venv; {_HOW[name]}")
    return name


@pytest.fixture(scope="session")
def _pools() -> Iterator[dict[tuple[str, int], WorkerPool]]:
    pools: dict[tuple[str, int], WorkerPool] = {}
    yield pools
    for pool in pools.values():
        pool.close()


@pytest.fixture
def pool(framework: str, _pools: dict[tuple[str, int], WorkerPool]
         ) -> Callable[[int], WorkerPool]:
    """``pool(n)``: the session's pool of ``n`` ranks of this framework (started on first use)."""

    def get(n: int) -> WorkerPool:
        key = (framework, n)
        if key not in _pools:
            _pools[key] = WorkerPool(n, backend=BACKENDS[framework],
                                     start_timeout_s=START_TIMEOUT_S,
                                     collective_timeout_s=COLLECTIVE_TIMEOUT_S,
                                     env=dict(_ENV[framework]))
        return _pools[key]

    return get
