"""The examples this package owns run with one command on the cpu backend (fast variants)."""

from __future__ import annotations

from .conftest import hyperpar_cmd


def test_tp_mlp_example_trains_and_matches_single_process():
    proc = hyperpar_cmd("run", "-n", "2", "--backend", "cpu", "examples/tp_mlp.py",
                        "--steps", "3")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "step 3/3 | loss" in proc.stdout
    assert "tp_mlp: OK" in proc.stdout
