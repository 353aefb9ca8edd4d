"""The README's main demo (examples/demo.py) trains pp2 x tp2 and matches one process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_main_demo_pp2_tp2_matches_one_process():
    proc = subprocess.run([sys.executable, "examples/demo.py", "--steps", "3"], cwd=REPO,
                          env={**os.environ, "HYPERPAR_BACKEND": "cpu"},
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[pp2xtp2] step 2: loss" in proc.stdout
    assert "-> OK" in proc.stdout


def test_demo_compare_detects_a_parameter_mismatch():
    sys.path.insert(0, str(REPO / "examples"))
    import torch
    from demo import compare

    reference = {"losses": [1.0, 0.5], "params": {"w": torch.zeros(3)}}
    same = [{"losses": [1.0, 0.5], "params": {"w": torch.zeros(3)}}]
    off = [{"losses": None, "params": {"w": torch.tensor([0.0, 0.1, 0.0])}},
           {"losses": [1.0, 0.5], "params": {}}]
    assert compare(same, reference) == 0.0
    assert abs(compare(off, reference) - 0.1) < 1e-6


def test_inspection_example_captures_full_activations_and_ablates_like_one_process():
    proc = subprocess.run([sys.executable, "examples/inspect_activations.py"], cwd=REPO,
                          env={**os.environ, "HYPERPAR_BACKEND": "cpu"},
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "layers.0.feed_forward.w1: full shape (2, 16, 128)" in proc.stdout
    assert proc.stdout.rstrip().endswith("-> OK")


def test_inspection_example_runs_one_rank_per_process_under_hyperpar_run():
    """Under a launcher the example must not spawn its own ranks (it hung under torchrun)."""
    proc = subprocess.run([sys.executable, "-m", "hyperpar", "run", "-n", "2",
                           "examples/inspect_activations.py"], cwd=REPO,
                          env={**os.environ, "HYPERPAR_BACKEND": "cpu"},
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("-> OK") == 1, proc.stdout  # rank 0 reports, once
    assert "MISMATCH" not in proc.stdout


def test_context_parallel_example_trains_like_one_process():
    proc = subprocess.run([sys.executable, "-m", "hyperpar", "run", "-n", "2",
                           "examples/context_parallel.py"], cwd=REPO,
                          env={**os.environ, "HYPERPAR_BACKEND": "cpu"},
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[cp2] step 2: loss" in proc.stdout
    assert proc.stdout.rstrip().endswith("-> OK"), proc.stdout
