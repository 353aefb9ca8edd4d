"""examples/torch_pipelining.py runs under ``hyperpar run -n 2`` and matches one process."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "torch_pipelining.py"


def test_example_runs_with_hyperpar_run_and_matches_one_process():
    proc = subprocess.run(
        [sys.executable, "-m", "hyperpar", "run", "-n", "2", str(EXAMPLE), "--schedule",
         "interleaved", "--steps", "3"],
        capture_output=True, text=True, timeout=180, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert len(re.findall(r"^step \d: loss \d", proc.stdout, re.M)) == 3, out[-3000:]
    diff = re.search(r"max \|param - one-process param\| on stages \[1, 3\]: (\S+)", proc.stdout)
    assert diff is not None, out[-3000:]
    assert float(diff.group(1)) < 1e-5
