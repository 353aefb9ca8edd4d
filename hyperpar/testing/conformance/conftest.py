"""Shared parametrisation for the conformance kit."""

import pytest

WORLD_SIZES = (2, 4)


@pytest.fixture(params=WORLD_SIZES, ids=lambda n: f"{n}ranks")
def world_size(request) -> int:
    return request.param
