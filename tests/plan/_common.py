"""Paths and small helpers shared by the planner tests."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "examples" / "configs"
LLAMA2_7B = CONFIGS / "llama-2-7b.json"
LLAMA3_70B = CONFIGS / "llama-3-70b.json"

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
