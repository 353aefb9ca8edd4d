"""Shared helpers for the tensor-parallel tests: the example model and its plans."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from examples.llama import model as llama  # noqa: E402
from examples.llama import plan as plans  # noqa: E402

__all__ = ["ROOT", "llama", "plans"]
