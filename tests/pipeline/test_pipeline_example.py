"""examples/pipeline_tied.py runs and matches the single-process model (it spawns 2 ranks)."""

from __future__ import annotations

import importlib
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_tied_pipeline_example_matches_one_process(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))   # spawned ranks import it by name too
    example = importlib.import_module("pipeline_tied")
    out = example.demo(world_size=2, steps=3, n_microbatches=3, verbose=False)
    assert len(out["pipeline"]) == 3
    assert out["max_abs_diff"] < 1e-4
