"""pytest plugin of hyperpar (auto-loaded through the ``pytest11`` entry point).

Options:

* ``--hyperpar-backend=NAME`` -- the backend every test (and every spawned rank) uses;
  default ``HYPERPAR_BACKEND`` or auto-detect.
* ``--hyperpar-emulate`` -- install the CPU emulation of the backend's device module first
  (supported: ``npu``); see :mod:`hyperpar.testing.emulation`.

Fixtures:

* ``hyperpar_backend`` -- the backend name in force.
* ``run_on_ranks`` -- ``run_on_ranks(world_size, fn, *args, timeout_s=..., **kwargs)`` runs a
  module-level function on real processes (pooled per world size for the whole session) and
  returns the per-rank results. On a backend with one device per rank (cuda, npu), a world
  larger than the visible devices skips the test with the reason instead of failing.
* ``hyperpar_max_ranks`` -- the most ranks the backend can host here (``None``: no limit), with
  the reason in ``.reason``.

Run the backend conformance kit with ``pytest --pyargs hyperpar.testing.conformance
--hyperpar-backend=NAME``.

The plugin is loaded into every pytest session of an environment that has hyperpar installed, so
at import it touches neither torch nor a backend: those load only when a fixture or an option of
the plugin is used.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from .harness import WorkerPool


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("hyperpar")
    group.addoption("--hyperpar-backend", default=None,
                    help="hyperpar backend for tests and spawned ranks (default: auto)")
    group.addoption("--hyperpar-emulate", action="store_true", default=False,
                    help="emulate the backend's device module on the CPU (npu)")


def pytest_configure(config: pytest.Config) -> None:
    name = config.getoption("--hyperpar-backend", default=None)
    if name:
        os.environ["HYPERPAR_BACKEND"] = name
    if config.getoption("--hyperpar-emulate", default=False):
        from .emulation import emulation_for

        os.environ["HYPERPAR_EMULATE"] = "1"
        emulation_for(os.environ.get("HYPERPAR_BACKEND", ""))()
    config.addinivalue_line("markers", "hyperpar_ranks(n): test needs n real processes")


class RankLimit(int):
    """The most ranks the selected backend can run on this host, with the reason why."""

    reason: str


def max_ranks() -> RankLimit | None:
    """The selected backend's :meth:`~hyperpar.platform.Platform.max_local_ranks` (``None``: no
    limit), with a reason fit for a skip message."""
    from hyperpar.platform import get_platform

    platform = get_platform()
    limit = platform.max_local_ranks()
    if limit is None:
        return None
    env = platform.visible_devices_env
    shown = f" ({env}={os.environ[env]})" if env and env in os.environ else ""
    out = RankLimit(limit)
    out.reason = (f"backend {platform.name} runs one rank per device and {limit} "
                  f"{platform.device_type} device(s) are visible{shown}")
    return out


def _worker_setup() -> Callable[[], None] | None:
    if os.environ.get("HYPERPAR_EMULATE"):
        from .emulation import emulation_for

        return emulation_for(os.environ.get("HYPERPAR_BACKEND", ""))
    return None


@pytest.fixture(scope="session")
def hyperpar_backend() -> str:
    """Name of the backend the tests run on."""
    from hyperpar.platform import get_platform

    return get_platform().name


@pytest.fixture
def hyperpar_max_ranks() -> RankLimit | None:
    """The most ranks the backend can host here (``None``: no limit); ``.reason`` says why."""
    return max_ranks()


@pytest.fixture(scope="session")
def _hyperpar_pools() -> Iterator[dict[int, WorkerPool]]:
    pools: dict[int, WorkerPool] = {}
    yield pools
    for pool in pools.values():
        pool.close()


@pytest.fixture
def run_on_ranks(_hyperpar_pools: dict[int, WorkerPool]) -> Callable[..., list[Any]]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` real processes; per-rank results."""

    from .harness import DEFAULT_TIMEOUT_S, WorkerPool

    def run(world_size: int, fn: Callable[..., Any], *args: Any,
            timeout_s: float = DEFAULT_TIMEOUT_S, **kwargs: Any) -> list[Any]:
        limit = max_ranks()
        if limit is not None and world_size > limit:
            pytest.skip(f"needs {world_size} ranks; {limit.reason}")
        pool = _hyperpar_pools.get(world_size)
        if pool is None:
            pool = _hyperpar_pools[world_size] = WorkerPool(
                world_size, backend=os.environ.get("HYPERPAR_BACKEND") or None,
                setup=_worker_setup(),
            )
        return pool.run(fn, *args, timeout_s=timeout_s, **kwargs)

    return run
