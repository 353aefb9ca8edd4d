"""A run whose every rank finished its script is a success, even if a rank then crashes while
the interpreter tears down (torch/gloo's "terminate called without an active exception")."""

from __future__ import annotations

import textwrap

from .conftest import hyperpar_cmd

CRASH_AT_EXIT = """
    import atexit, os
    import torch
    from hyperpar.platform import get_platform

    platform = get_platform()
    platform.init_process_group()
    t = torch.ones(2)
    platform.all_reduce(t)
    print(f"rank {platform.rank()} done: {t.tolist()}", flush=True)
    if platform.rank() == 1:
        atexit.register(os.abort)  # SIGABRT after the script returned, as torch's teardown does
"""


def test_a_crash_after_the_script_finished_is_not_reported_as_a_failure(tmp_path):
    script = tmp_path / "aborts_at_exit.py"
    script.write_text(textwrap.dedent(CRASH_AT_EXIT))
    proc = hyperpar_cmd("run", "-n", "2", "--quiet", "--backend", "cpu", str(script))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 0 done: [2.0, 2.0]" in proc.stdout and "rank 1 done" in proc.stdout
    assert "FAILED" not in proc.stderr
    assert ("every rank finished" in proc.stderr
            and "rank(s) 1 then exited abnormally during interpreter teardown" in proc.stderr)


RAISES_AFTER_WORK = """
    from hyperpar.platform import get_platform

    platform = get_platform()
    platform.init_process_group()
    platform.barrier()
    if platform.rank() == 1:
        raise RuntimeError("checkpoint upload failed")
"""


def test_a_rank_that_raises_at_the_end_still_fails_the_run(tmp_path):
    script = tmp_path / "raises.py"
    script.write_text(textwrap.dedent(RAISES_AFTER_WORK))
    proc = hyperpar_cmd("run", "-n", "2", "--quiet", "--backend", "cpu", str(script))
    assert proc.returncode == 1
    assert proc.stderr.rstrip().splitlines()[-2] == "rank 1: RuntimeError: checkpoint upload failed"
