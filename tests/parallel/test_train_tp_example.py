"""examples/llama/train_tp.py trains in parity with one process (the README demo's TP part)."""

import pytest
from _tp_llama import ROOT  # noqa: F401  (puts the repository root on sys.path)

from examples.llama import train_tp


@pytest.mark.parametrize("sp, loss_parallel", [(False, False), (True, True)])
def test_train_tp_example_reports_parity(run_on_ranks, sp, loss_parallel):
    results = run_on_ranks(2, train_tp.train, 2, sp, verbose=False,
                           use_loss_parallel=loss_parallel)
    assert all(r["ok"] for r in results), results
