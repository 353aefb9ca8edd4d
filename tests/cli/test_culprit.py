"""`hyperpar run` blames the rank that did not reach a collective, and refuses bad counts."""

from __future__ import annotations

import textwrap
from types import SimpleNamespace

from hyperpar.launcher import (
    LaunchOptions,
    collect_failures,
    format_failures,
    launch,
    worker_env,
)

from .conftest import REPO, hyperpar_cmd

HANG = """
    import sys, time
    import torch
    from hyperpar.platform import get_platform

    platform = get_platform()
    platform.init_process_group()
    t = torch.ones(4)
    platform.all_reduce(t)
    if platform.rank() == 1:
        time.sleep(120)  # never reaches the second all_reduce in time
    platform.all_reduce(t)
"""


def test_a_hang_names_the_rank_that_did_not_reach_the_collective(tmp_path):
    script = tmp_path / "rank1_hangs.py"
    script.write_text(textwrap.dedent(HANG))
    proc = hyperpar_cmd("run", "-n", "2", "--quiet", "--backend", "cpu", "--timeout", "4",
                        str(script))
    assert proc.returncode == 1
    tail = "\n".join(proc.stderr.rstrip().splitlines()[-40:])
    assert "culprit: rank 1 (local rank 1)" in tail, tail
    assert "first failure: rank 0" not in tail, tail
    last = proc.stderr.rstrip().splitlines()[-2]
    assert last.startswith("rank 1: rank 1 did not reach all_reduce #2 (rank 0 waited"), tail
    assert "where rank 0 waited for it:" in tail and "rank1_hangs.py" in tail


def _failure(exitcode: int, message, rank: int) -> SimpleNamespace:
    return SimpleNamespace(exitcode=exitcode, message=message, local_rank=rank,
                           timestamp=100 + rank)


def test_a_culprit_that_exited_cleanly_is_still_named():
    """Rank 1 finished its script without the collective (exit 0, so torchrun does not list
    it); rank 0's diagnosis names it and the summary blames rank 1, not rank 0."""
    diagnosis = "rank 1 did not reach barrier #3 (rank 0 waited 4.0 s in it)"
    rank0 = {"message": f"CollectiveError: {diagnosis}",
             "extraInfo": {"py_callstack": "Traceback ...\n", "hyperpar_culprits": [1],
                           "hyperpar_diagnosis": diagnosis}}
    rows = collect_failures(SimpleNamespace(failures={0: _failure(1, rank0, 0)}))
    assert [r.rank for r in rows] == [0, 1]
    text = format_failures("train.py", rows)
    assert "culprit: rank 1 (local rank ?), exit code 0" in text
    assert text.splitlines()[-2].startswith(f"rank 1: {diagnosis} [rank 1 did not fail")


def test_zero_processes_is_a_clear_error_before_launching(capsys):
    script = REPO / "examples" / "collectives_smoke.py"
    assert launch(LaunchOptions(script=str(script), nproc_per_node="0", backend="cpu")) == 2
    err = capsys.readouterr().err
    assert "-n/--nproc-per-node must be a positive number of processes" in err
    assert "got '0'" in err


def test_timeout_option_sets_the_collective_timeout_of_every_worker(capsys):
    assert worker_env("cpu", None, quiet=False, timeout_s=7.5)["HYPERPAR_TIMEOUT"] == "7.5"
    script = REPO / "examples" / "collectives_smoke.py"
    assert launch(LaunchOptions(script=str(script), backend="cpu", timeout_s=0.0)) == 2
    assert "--timeout must be a positive number of seconds" in capsys.readouterr().err


def test_run_help_documents_the_timeout_and_debug_variables():
    proc = hyperpar_cmd("run", "--help")
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    assert "--timeout S" in text and "HYPERPAR_TIMEOUT" in text
    assert "HYPERPAR_DEBUG_COLLECTIVES=1" in text
