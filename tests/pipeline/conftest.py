"""In-process pipeline tests build a ``PipelineModule`` with no launcher: it joins a world of
one (the rule ``init_device_mesh`` follows). Leave the test process as each test found it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from hyperpar.platform import get_platform


@pytest.fixture(autouse=True)
def _leave_no_process_group() -> Iterator[None]:
    platform = get_platform()
    had_group = platform.is_initialized()
    yield
    if not had_group and platform.is_initialized():
        platform.destroy_process_group()
