"""Fixtures for registry tests: a fake installed distribution with its own entry point."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from hyperpar.platform import registry


@pytest.fixture(autouse=True)
def _fresh_registry(monkeypatch) -> Iterator[None]:
    """Every test starts with no cached selection and no HYPERPAR_BACKEND."""
    monkeypatch.delenv("HYPERPAR_BACKEND", raising=False)
    registry.reset()
    yield
    registry.reset()


@pytest.fixture
def install_distribution(tmp_path: Path, monkeypatch) -> Callable[..., Path]:
    """Write a package plus ``<name>.dist-info`` (METADATA, entry_points.txt) into a folder on
    ``sys.path`` -- exactly what ``pip install`` leaves behind, minus pip."""

    def install(dist_name: str, module: str, source: str, entry_name: str | None = None) -> Path:
        root = tmp_path / f"site-{dist_name}"
        (root / module).mkdir(parents=True)
        (root / module / "__init__.py").write_text(textwrap.dedent(source))
        info = root / f"{dist_name.replace('-', '_')}-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {dist_name}\nVersion: 0.1\n"
        )
        (info / "entry_points.txt").write_text(
            f"[hyperpar.backends]\n{entry_name or module} = {module}\n"
        )
        monkeypatch.syspath_prepend(str(root))
        registry.reset()
        return root

    yield install
    for name in [m for m in sys.modules if m.startswith("hyperpar_dummy")]:
        del sys.modules[name]
