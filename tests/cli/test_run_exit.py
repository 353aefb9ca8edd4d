"""How ``hyperpar run`` reports the end of a job: a rank that finished its script and then
crashed while the interpreter shut down is a failure, reported as exactly that (the script
returned; what ran at exit may be incomplete) -- never as a success, never as a crash inside
the script."""

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


def test_an_abort_after_the_script_finished_is_reported_as_such_and_fails(tmp_path):
    script = tmp_path / "aborts_at_exit.py"
    script.write_text(textwrap.dedent(CRASH_AT_EXIT))
    proc = hyperpar_cmd("run", "-n", "2", "--quiet", "--backend", "cpu", str(script))
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "rank 0 done: [2.0, 2.0]" in proc.stdout and "rank 1 done" in proc.stdout
    last = proc.stderr.rstrip().splitlines()[-1]
    assert last.startswith("hyperpar run: FAILED at exit: every failed rank had finished "), last
    assert "then rank 1 was killed by signal 6 (SIGABRT) while the interpreter shut down" in last
    assert "Traceback" not in proc.stderr  # not mistaken for an exception in the script


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
