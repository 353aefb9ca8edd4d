"""Fixtures of the command-line tests: a clean backend selection and the repository root."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from hyperpar.platform import registry

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _fresh_selection(monkeypatch) -> Iterator[None]:
    """Every test starts with no cached selection, no HYPERPAR_BACKEND and not quiet."""
    monkeypatch.delenv("HYPERPAR_BACKEND", raising=False)
    monkeypatch.delenv("HYPERPAR_QUIET", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    registry.reset()
    yield
    registry.reset()


def _env(extra: dict[str, str] | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("HYPERPAR_BACKEND", "HYPERPAR_QUIET", "RANK")}
    env.update(extra or {})
    return env


def hyperpar_cmd(*args: str, env: dict[str, str] | None = None,
                 timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``python -m hyperpar ARGS`` from the repository root; stdout and stderr captured."""
    return subprocess.run([sys.executable, "-m", "hyperpar", *args], cwd=REPO, env=_env(env),
                          capture_output=True, text=True, timeout=timeout)


def hyperpar_popen(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``python -m hyperpar ARGS`` without waiting (for several launchers at once)."""
    return subprocess.Popen([sys.executable, "-m", "hyperpar", *args], cwd=REPO, env=_env(env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
