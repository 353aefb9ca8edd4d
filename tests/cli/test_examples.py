"""The examples this package owns run with one command on the cpu backend (fast variants)."""

from __future__ import annotations

import os
import subprocess
import sys

from .conftest import REPO, hyperpar_cmd


def test_tp_mlp_example_trains_and_matches_single_process():
    proc = hyperpar_cmd("run", "-n", "2", "--backend", "cpu", "examples/tp_mlp.py",
                        "--steps", "3")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "step 3/3 | loss" in proc.stdout
    assert "tp_mlp: OK" in proc.stdout


def test_collectives_smoke_spawns_its_own_ranks_without_a_launcher():
    proc = subprocess.run([sys.executable, "examples/collectives_smoke.py"], cwd=REPO,
                          env={**os.environ, "HYPERPAR_BACKEND": "cpu"},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rank 1/2 reduce_scatter [2.0]" in proc.stdout
    assert proc.stdout.rstrip().endswith("OK: cpu (device=cpu, collectives=gloo) with 2 ranks")
