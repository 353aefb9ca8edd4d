"""Collecting ``tests/both`` imports no framework of its own accord: the adapter imports torch or
MindSpore only inside a rank (``_frameworks.get``), so the torch venv never imports mindspore and
the MindSpore venv never imports torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_importing_the_test_modules_imports_no_mindspore_and_no_extra_torch() -> None:
    code = (
        "import sys\n"
        "import hyperpar.testing.harness\n"
        "from hyperpar import Partial, Replicate, Shard  # the neutral names the bodies use\n"
        "before = {m.split('.')[0] for m in sys.modules}\n"
        "import tests.both.conftest, tests.both._frameworks, tests.both.test_redistribute\n"
        "import tests.both.test_ops, tests.both.test_tp\n"
        "after = {m.split('.')[0] for m in sys.modules}\n"
        "print(sorted((after - before) & {'torch', 'mindspore'}))\n"
        "print('mindspore' in after)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, check=True).stdout.split("\n")
    assert out[0] == "[]", out          # the test modules add no framework import
    assert out[1] == "False", out       # and nothing on the way imports mindspore
