"""Shared parametrisation for the conformance kit: world sizes 1, 2 and 4, as far as the backend
can host them (a backend with one device per rank runs only as many ranks as devices are
visible; the sizes it cannot host are skipped with the reason)."""

import pytest

WORLD_SIZES = (1, 2, 4)


@pytest.fixture(params=WORLD_SIZES, ids=lambda n: f"{n}ranks")
def world_size(request, hyperpar_max_ranks) -> int:
    n = request.param
    if hyperpar_max_ranks is not None and n > hyperpar_max_ranks:
        pytest.skip(f"needs {n} ranks; {hyperpar_max_ranks.reason}")
    return n


@pytest.fixture
def multi_rank_world_size(world_size) -> int:
    """``world_size`` for checks that need at least two ranks (a ring, two sub-groups)."""
    if world_size < 2:
        pytest.skip("needs at least 2 ranks (a peer to talk to)")
    return world_size
